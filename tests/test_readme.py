"""The README's runnable examples run (a newcomer copies them first)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_runnable_readme_blocks_execute(capsys):
    blocks = re.findall(r"```python\n(# runnable.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2, "README.md should hold the engine and the TorchRec examples"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "{'user+item': 0}" in out  # the engine alone: no critical-path miss
    assert "critical-path misses 0" in out  # the TorchRec model under the pipeline
