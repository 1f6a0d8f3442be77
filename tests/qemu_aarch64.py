"""Run TVM-compiled aarch64 kernels under qemu-user, without a TVM runtime (test support).

The kernel module is written as an aarch64 object, statically linked with
``tests/aarch64/driver.c`` (which builds the DLTensor arguments and calls ``main``), and run
with ``qemu-aarch64 -cpu max`` (Armv8.6+ incl. i8mm and bf16).  Needs the Debian packages
``qemu-user`` and ``gcc-aarch64-linux-gnu``.

Example
-------
>>> runner = QemuRunner(tmp_path)                       # doctest: +SKIP
>>> a, b, c = runner.run(ex.mod, [a, b, c])             # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

TARGET = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon", "+i8mm", "+bf16"]}
QEMU = "qemu-aarch64"
CC = "aarch64-linux-gnu-gcc"
DRIVER = Path(__file__).parent / "aarch64" / "driver.c"
INSTALL_HINT = "apt-get install -y qemu-user gcc-aarch64-linux-gnu"


#: An aarch64 CPython with TVM under qemu (``tests/aarch64/python_sysroot.sh DEST`` writes
#: ``DEST/python``): the ARM RPC server of the remote-tuning tests.
PYTHON = Path(os.environ.get("TPP_AARCH64_PYTHON",
                             Path.home() / ".cache" / "tvm-tpp" / "aarch64-python" / "python"))


def python_missing() -> str | None:
    """Why no aarch64 TVM server can be started here, or None when it can."""
    if shutil.which(QEMU) is None or shutil.which(CC) is None:
        return missing()
    if not os.access(PYTHON, os.X_OK):
        return (f"no aarch64 Python with TVM at {PYTHON} (make it with "
                f"tests/aarch64/python_sysroot.sh {PYTHON.parent}, or set TPP_AARCH64_PYTHON)")
    return None


def missing() -> str | None:
    """Why aarch64 code cannot be run here, or None when it can."""
    absent = [tool for tool in (QEMU, CC) if shutil.which(tool) is None]
    if absent:
        return f"{' and '.join(absent)} not installed ({INSTALL_HINT})"
    return None


def _dlpack_dtype(dtype: np.dtype) -> tuple[int, int]:
    if dtype.name == "bfloat16":
        return 4, 16
    kinds = {"i": 0, "u": 1, "f": 2}
    if dtype.kind not in kinds:
        raise TypeError(f"no DLPack code for numpy dtype {dtype}")
    return kinds[dtype.kind], dtype.itemsize * 8


class QemuRunner:
    """Links kernel objects with the C driver and runs them under qemu, in ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        import tvm_ffi

        reason = missing()
        if reason:
            raise RuntimeError(reason)
        self.workdir = Path(workdir)
        self.driver = self.workdir / "driver.o"
        include = Path(tvm_ffi.__file__).parent / "include"
        subprocess.run([CC, "-O2", "-Wall", "-Werror", f"-I{include}", "-c", str(DRIVER),
                        "-o", str(self.driver)], check=True, capture_output=True, text=True)
        self._count = 0

    def run(self, module, arrays: list[np.ndarray], timeout: float = 60) -> list[np.ndarray]:
        """Call the module's ``main`` on ``arrays``; returns every tensor as left by the call."""
        self._count += 1
        stem = self.workdir / f"kernel{self._count}"
        obj, exe = stem.with_suffix(".o"), stem.with_suffix(".exe")
        module.write_to_file(str(obj))
        subprocess.run([CC, "-static", str(self.driver), str(obj), "-o", str(exe)],
                       check=True, capture_output=True, text=True)
        specs = []
        for i, array in enumerate(arrays):
            path = stem.with_name(f"{stem.name}_arg{i}.bin")
            np.ascontiguousarray(array).tofile(path)
            code, bits = _dlpack_dtype(array.dtype)
            specs.append(",".join([str(code), str(bits), str(path), *map(str, array.shape)]))
        done = subprocess.run([QEMU, "-cpu", "max", str(exe), *specs], capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{exe.name} exited with {done.returncode}: {done.stderr.strip()}")
        return [
            np.fromfile(f"{spec.split(',')[2]}.out", dtype=array.dtype).reshape(array.shape)
            for spec, array in zip(specs, arrays, strict=True)
        ]
