"""fp16 tables (TorchRec `data_type=FP16`): stored, cached and staged as fp16 by distcache's
kernel, equal to TorchRec's own fp16 tables within fp16 rounding. (The DCP round trip is in
test_checkpoint.py.)"""

import pytest

from tests.distributed.fp16_case import train_against_torchrec
from tests.distributed.harness import run_ranks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise"])
def test_fp16_tables_train_as_torchrecs_within_fp16_rounding(kind):
    for result in run_ranks(train_against_torchrec, 2, args=(kind,), timeout_s=150):
        assert result["dtypes"] == ["torch.float16"], result
        assert result["moved"] > 0.1, result  # the rows trained
        # One fp16 ulp near 1 is 2**-10: the rows end within two of TorchRec's (measured:
        # half an ulp), the pooled outputs within four.
        assert result["gap"] <= 2 * 2**-10, result
        assert result["out_gap"] <= 4 * 2**-10, result
