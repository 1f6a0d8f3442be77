"""TVMScript builders keep parsing the source their module was imported with
(microkernels.script_source): a file replaced under a running process changes no kernel."""

import importlib
import sys
import textwrap

import pytest
import tvm

BUILDER = '''
from tvm.script import tirx as T
{pin}

def scaled(n: int):
    @T.prim_func(s_tir=True)
    def kernel(x: T.Buffer((n,), "float32"), y: T.Buffer((n,), "float32")):
        for i in range(n):
            with T.sblock("scale"):
                vi = T.axis.remap("S", [i])
                y[vi] = x[vi] * T.float32({factor})

    return kernel
'''


def _module(tmp_path, name: str, pinned: bool, factor: float):
    pin = "from microkernels.script_source import pin_source\npin_source(__name__)"
    (tmp_path / f"{name}.py").write_text(BUILDER.format(pin=pin if pinned else "",
                                                        factor=factor))
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))


def _replace(tmp_path, name: str, factor: float) -> None:
    """The file rewritten as an upgrade would: other text, other line numbers."""
    new = "# a newer version\n\n" + BUILDER.format(pin="", factor=factor)
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(new))


def test_pinned_builder_parses_the_imported_source(tmp_path):
    module = _module(tmp_path, "pinned_builder", pinned=True, factor=2.0)
    before = module.scaled(8)
    _replace(tmp_path, "pinned_builder", factor=3.0)
    tvm.ir.assert_structural_equal(module.scaled(8), before)


def test_unpinned_builder_reads_the_new_file(tmp_path):
    """What the pin prevents: TVM's parser reads whatever the file holds now."""
    module = _module(tmp_path, "unpinned_builder", pinned=False, factor=2.0)
    before = module.scaled(8)
    _replace(tmp_path, "unpinned_builder", factor=3.0)
    try:
        after = module.scaled(8)
    except Exception:  # noqa: BLE001 - the parser's error is the failure shown
        return
    with pytest.raises(ValueError):
        tvm.ir.assert_structural_equal(after, before)
