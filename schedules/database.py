"""Tuning results on disk: what a result is valid for (:class:`TuningKey`) and the JSON file
that keeps them (:class:`Database`).

One file maps each key's text to a record: the kept configuration and whatever the tuner
noted of its measurements.  The same operator on the same machine then costs nothing the
second time.

Examples
--------
>>> from schedules.gemm import GemmConfig
>>> key = TuningKey("dense", (48, 64, 96), "", "float32", "", "avx2/haswell/1t")
>>> db = Database(tmp_path / "tuning.json")                          # doctest: +SKIP
>>> db.put(key, GemmConfig.of("BCa", 48, 64, 96), gflops=80.0)      # doctest: +SKIP
>>> db.get(key).spec                                                 # doctest: +SKIP
'BCa'
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from microkernels.machine import machine_of

from .ops import OPS, Config, Problem, op_of, shape_text

if TYPE_CHECKING:
    from tvm.target import Target

__all__ = ["TuningKey", "Database"]


@dataclass(frozen=True)
class TuningKey:
    """What a tuning result is valid for.

    ``shape`` holds the operator's sizes (dense ``m, n, k``; conv ``n, c, h, w, k, r, s``;
    batch GEMM ``batch, m, n, k``) and ``layout`` whatever else sets two problems of those
    sizes apart (conv strides and padding, batch-GEMM operand layouts, "" for dense), so
    dense keys read as they always did.  ``target`` is the machine's
    :attr:`~microkernels.machine.Machine.key`.

    Examples
    --------
    >>> TuningKey("dense", (48, 64, 96), "", "float32", "bias", "avx2/haswell/1t").text()
    'dense|48x64x96|float32|bias|avx2/haswell/1t'
    """

    op: str
    shape: tuple[int, ...]
    layout: str
    dtype: str
    epilogue: str
    target: str

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; the tuner handles {', '.join(OPS)}")

    @classmethod
    def of(cls, problem: Problem, target: Target) -> TuningKey:
        """The key of ``problem`` on the machine of ``target`` (a ``tpp`` target)."""
        op = op_of(problem)
        shape, layout, dtype = op.key(problem)
        return cls(op.name, shape, layout, dtype, problem.epilogue.name,
                   machine_of(target).key)

    def text(self) -> str:
        return (f"{self.op}|{shape_text(self.shape, self.layout)}|{self.dtype}|"
                f"{self.epilogue}|{self.target}")


class Database:
    """Tuning results in one JSON file, rewritten atomically on every update.

    Parameters
    ----------
    path
        The file; created on the first :meth:`put`.

    Raises
    ------
    ValueError
        The file holds no valid JSON.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._records: dict[str, dict] = {}
        if self.path.is_file():
            try:
                self._records = json.loads(self.path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"tuning database {self.path} is corrupt: {err}") from None

    def __len__(self) -> int:
        return len(self._records)

    def get(self, key: TuningKey) -> Config | None:
        """The configuration kept for ``key``, or None."""
        record = self._records.get(key.text())
        return OPS[key.op].from_json(record["config"]) if record else None

    def record(self, key: TuningKey) -> dict | None:
        """The stored record (config, measured GFLOPS, tuning seconds, measurements)."""
        return self._records.get(key.text())

    def put(self, key: TuningKey, config: Config, **details: object) -> None:
        """Keep ``config`` for ``key`` with ``details`` (JSON values) and write the file."""
        self._records[key.text()] = {"config": OPS[key.op].to_json(config), **details}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self._records, indent=1, sort_keys=True))
        tmp.replace(self.path)
