"""The README's runnable examples run (a newcomer copies them first)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_runnable_readme_blocks_execute(capsys):
    blocks = re.findall(r"```python\n(# runnable.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md should hold at least one runnable example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    assert "{'user+item': 0}" in capsys.readouterr().out  # no critical-path miss
