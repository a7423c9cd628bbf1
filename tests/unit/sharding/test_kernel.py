"""The kernel's optimizer names: one map from distcache's names to TorchRec's, and back."""

import pytest
import torch
from torchrec.distributed.utils import optimizer_type_to_emb_opt_type

from distcache.cache.config import OPTIMIZERS
from distcache.errors import DistcacheConfigError
from distcache.sharding import EMBEDDING_OPTIMIZERS
from distcache.sharding.kernel import cache_config_from_fused_params


def test_every_cache_optimizer_has_a_torchrec_class():
    assert set(EMBEDDING_OPTIMIZERS) == set(OPTIMIZERS)


@pytest.mark.parametrize("name", sorted(EMBEDDING_OPTIMIZERS))
def test_a_name_comes_back_through_torchrec(name):
    fused = optimizer_type_to_emb_opt_type(EMBEDDING_OPTIMIZERS[name])
    assert cache_config_from_fused_params({"optimizer": fused}).optimizer == name


def test_fused_params_distcache_would_not_apply_are_refused():
    """Weight decay with a mode that applies it, and gradient clipping, change FBGEMM's update:
    refused in one line, not ignored. A `weight_decay` without a mode (what
    `apply_optimizer_in_backward(torch.optim.Adagrad, ..., {"weight_decay": ...})` gives)
    runs FBGEMM in its default mode, NONE: accepted."""
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

    assert cache_config_from_fused_params({"weight_decay": 0.5}).optimizer == "sgd"
    none = {"weight_decay": 0.5, "weight_decay_mode": WeightDecayMode.NONE}
    cache_config_from_fused_params(none)
    l2 = {"weight_decay": 0.5, "weight_decay_mode": WeightDecayMode.L2}
    with pytest.raises(DistcacheConfigError, match=r"weight_decay_mode=L2: .* no weight decay"):
        cache_config_from_fused_params(l2)
    cache_config_from_fused_params({**l2, "weight_decay": 0.0})  # a mode without a decay
    with pytest.raises(DistcacheConfigError, match=r"gradient_clipping=True: .* does not clip"):
        cache_config_from_fused_params({"gradient_clipping": True, "max_gradient": 1.0})


def test_torchrecs_stochastic_rounding_param_reaches_the_cache_config():
    """False turns it off; True (TorchRec's default, also when absent) keeps the config's,
    by default FBGEMM's behaviour: stochastic on CUDA, to nearest on CPU."""
    off = cache_config_from_fused_params({"stochastic_rounding": False})
    assert off.stochastic_rounding is False
    for params in ({"stochastic_rounding": True}, {}):
        config = cache_config_from_fused_params(params)
        assert config.stochastic_rounding is None
        assert config.rounds_stochastically(torch.device("cuda"))
        assert not config.rounds_stochastically(torch.device("cpu"))
