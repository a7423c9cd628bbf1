"""The TorchRec modules a distcache workload stands for: its pooled tables as an
`EmbeddingBagCollection` (`workload_ebc`), its sequence tables (`TableStats.pooled` False) as an
`EmbeddingCollection` (`workload_ec`), each table named as TorchRec can hold it
(`torchrec_names`). `export.py` plans them and TorchRec's planner (`planner.py`) prices them.

Example::

    ebc = workload_ebc(workload)  # on the meta device: shapes, no weights
"""

from __future__ import annotations

import torch
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from torchrec.modules.embedding_configs import DataType

from distcache.errors import DistcacheConfigError
from distcache.planner.types import TableStats, Workload


def workload_ebc(
    workload: Workload, *, device: str | torch.device = "meta"
) -> EmbeddingBagCollection:
    """An `EmbeddingBagCollection` with the workload's pooled tables (`TableStats.pooled`),
    named as `torchrec_names` says, one feature per table named like the table, 2-byte rows as
    FP16 (on the meta device by default: planning needs shapes, not weights)."""
    tables = [t for t in workload.tables if t.pooled]
    if not tables:
        raise DistcacheConfigError(f"workload {workload.name!r} has no pooled tables")
    configs = [EmbeddingBagConfig(**_config_fields(workload, t)) for t in tables]
    return EmbeddingBagCollection(tables=configs, device=torch.device(device))


def workload_ec(workload: Workload, *, device: str | torch.device = "meta") -> EmbeddingCollection:
    """An `EmbeddingCollection` with the workload's sequence tables (`TableStats.pooled`
    False), named and typed as `workload_ebc` does; TorchRec's collection needs them all of one
    dim."""
    tables = [t for t in workload.tables if not t.pooled]
    if not tables:
        raise DistcacheConfigError(f"workload {workload.name!r} has no sequence tables")
    dims = sorted({t.dim for t in tables})
    if len(dims) > 1:
        raise DistcacheConfigError(
            f"workload {workload.name!r}: its sequence tables have dims {dims}, but one "
            "EmbeddingCollection's tables share one dim; plan each dim's tables as a workload "
            "of its own"
        )
    configs = [EmbeddingConfig(**_config_fields(workload, t)) for t in tables]
    return EmbeddingCollection(tables=configs, device=torch.device(device))


def _config_fields(workload: Workload, table: TableStats) -> dict:
    data_type = {1: DataType.INT8, 2: DataType.FP16, 4: DataType.FP32}
    return {
        "name": torchrec_names(workload)[table.name],
        "num_embeddings": table.rows,
        "embedding_dim": table.dim,
        "feature_names": [table.name],
        "data_type": data_type.get(workload.element_bytes(table), DataType.FP32),
    }


def has_pooled_tables(workload: Workload) -> bool:
    """Whether some table of `workload` is an `EmbeddingBagCollection`'s (pooled)."""
    return any(t.pooled for t in workload.tables)


def has_sequence_tables(workload: Workload) -> bool:
    """Whether some table of `workload` is an `EmbeddingCollection`'s (not pooled)."""
    return any(not t.pooled for t in workload.tables)


def torchrec_names(workload: Workload) -> dict[str, str]:
    """The name of each table of `workload` in TorchRec (`workload_ebc`'s EBC, the sharding
    plans `to_sharding_plan` writes): its own, unless TorchRec cannot hold a table by that name.

    An EBC keeps its tables in an `nn.ModuleDict`, which refuses a name that is one of its
    attributes (`items`, `keys`, `values`, `type`, `to`, ...) or holds a '.'. Such a table is
    named with '.' turned to '_' and as many '_' appended as make it a name no other table
    has. `from_sharding_plan` reads either name.

    Example::

        torchrec_names(workload)  # {"users": "users", "items": "items_"}
    """
    taken = {t.name for t in workload.tables}
    out = {}
    for table in workload.tables:
        name = table.name
        if _torchrec_refuses(name):
            name = name.replace(".", "_") + "_"
            while name in taken or _torchrec_refuses(name):
                name += "_"
            taken.add(name)
        out[table.name] = name
    return out


def _torchrec_refuses(name: str) -> bool:
    """Whether `nn.ModuleDict` refuses `name` as a key (`nn.Module.add_module`'s checks)."""
    return not name or "." in name or hasattr(_MODULE_DICT, name)


_MODULE_DICT = torch.nn.ModuleDict()  # an instance: `training` and the like are set per instance
