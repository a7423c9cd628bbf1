"""The kernel's optimizer names: one map from distcache's names to TorchRec's, and back."""

import pytest
from torchrec.distributed.utils import optimizer_type_to_emb_opt_type

from distcache.cache.config import OPTIMIZERS
from distcache.sharding import EMBEDDING_OPTIMIZERS
from distcache.sharding.kernel import cache_config_from_fused_params


def test_every_cache_optimizer_has_a_torchrec_class():
    assert set(EMBEDDING_OPTIMIZERS) == set(OPTIMIZERS)


@pytest.mark.parametrize("name", sorted(EMBEDDING_OPTIMIZERS))
def test_a_name_comes_back_through_torchrec(name):
    fused = optimizer_type_to_emb_opt_type(EMBEDDING_OPTIMIZERS[name])
    assert cache_config_from_fused_params({"optimizer": fused}).optimizer == name
