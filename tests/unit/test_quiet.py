"""`distcache.quiet`: the known third-party warnings are filtered where they arise, by message
and module (or logger); the same warning from anywhere else still shows."""

from __future__ import annotations

import logging
import warnings

import pytest

from distcache.quiet import KNOWN, KnownWarning, install

WARNED = [k for k in KNOWN if not k.logger]
LOGGED = [k for k in KNOWN if k.logger]
# A message each entry's pattern matches, as the third party writes it.
EXAMPLES = {
    "`broadcast_buffers` is deprecated": "`broadcast_buffers` is deprecated. Use ...",
    "Please use DTensor instead": "Please use DTensor instead and we are deprecating "
    "ShardedTensor.",
    "HeuristicalStorageReservation": "HeuristicalStorageReservation is known to cause issues, ...",
    "`torch": "`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...",
    "fbgemm": "fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not "
    "registered to the Autograd key(s) ...",
}


def _example(known: KnownWarning) -> str:
    for start, text in EXAMPLES.items():
        if known.message.replace("\\", "").startswith(start.replace("\\", "")):
            return text
    return known.message.replace("\\", "")


def _shown(text: str, category: type[Warning], module: str) -> bool:
    """Whether `text` warned from `module` shows, with distcache's filters installed."""
    with warnings.catch_warnings(record=True) as caught:
        install()  # (again: pytest restores the filters that importing distcache installed)
        warnings.warn_explicit(text, category, f"{module.replace('.', '/')}.py", 1, module=module)
    return bool(caught)


@pytest.mark.parametrize("known", WARNED, ids=lambda k: k.message[:30])
def test_a_known_warning_is_filtered_from_its_modules_only(known: KnownWarning) -> None:
    text = _example(known)
    for module in known.modules:
        assert not _shown(text, known.category, module)
        assert not _shown(text, known.category, f"{module}.inner")
    assert _shown(text, known.category, "users_training_script")
    assert _shown("something else entirely", known.category, known.modules[0])


@pytest.mark.parametrize("known", LOGGED, ids=lambda k: k.logger)
def test_a_known_log_record_is_dropped_from_its_logger_only(
    known: KnownWarning, caplog: pytest.LogCaptureFixture
) -> None:
    logger = logging.getLogger(None if known.logger == "root" else known.logger)
    text = _example(known) + " (details)"
    with caplog.at_level(logging.WARNING):
        logger.warning(text)
        logger.warning("another warning")
        logging.getLogger("users_training_script").warning(text)
    assert [r.name for r in caplog.records] == [logger.name, "users_training_script"]
    assert caplog.records[0].getMessage() == "another warning"


def test_installing_again_adds_no_filter() -> None:
    with warnings.catch_warnings():
        install()
        filters = len(warnings.filters), len(logging.getLogger().filters)
        install()
        assert (len(warnings.filters), len(logging.getLogger().filters)) == filters
