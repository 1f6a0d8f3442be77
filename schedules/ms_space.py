"""The loop_spec space as a MetaSchedule design space, so MetaSchedule can measure it.

:func:`schedules.search.tune` times its candidates in-process.  This module hands the same
candidates to MetaSchedule instead, which brings its builders and runners (local or RPC, e.g.
a board on the network), its JSON database and its task scheduler:

* :func:`gemm_space` is a :class:`~tvm.s_tir.meta_schedule.space_generator.ScheduleFn` that
  returns one design space per candidate configuration, each built by
  :func:`schedules.gemm.schedule`.  The structural choices (loop order, blocking, parallel loops)
  are enumerated as separate spaces; the spaces have no ``sample_*`` decisions.
* :func:`tune_gemm_ms` runs ``ms.tune_tir`` over those spaces.  Its default search strategy,
  :func:`enumerate_strategy`, measures each space once, best-ranked first: MetaSchedule's
  ``"replay-trace"`` draws spaces at random *with replacement*, so with N spaces and N trials
  it measures only about 63 % of them (``"replay-trace"`` is still accepted).

Two MetaSchedule costs are avoided or paid once: :func:`local_builder` builds without
``default_build``'s ``import tvm.s_tir.tensor_intrin`` (30-60 s, paid again by every builder
process MetaSchedule spawns — it starts a fresh pool for each batch of candidates; our modules
arrive tensorized, so the workers need no intrinsic), while the tuning process itself still pays
that import once, inside ``TuneContext``.  MetaSchedule's import stays inside these functions:
nothing here loads on the default compile path.

The design spaces replay into the schedule MetaSchedule passes in the trace of
``schedule(problem, config, isa)`` (both start from ``workload(problem, bn)``, so every
instruction finds its block and loops).  The traces name this project's BRGEMM intrinsics, so
they must be registered (:func:`register_intrinsics`) in any process that replays a stored
record — before opening a ``JSONDatabase`` that holds some (it parses the traces on load).
A trace does not bind the first-call flag of a kernel that zeroes C on the first of several
calls (the binding is no schedule instruction): every replay is followed by
:func:`schedules.nest.bind_first_calls`.

Examples
--------
>>> import tvm_tpp
>>> from schedules.gemm import GemmProblem
>>> target = tvm_tpp.target("tpp", num_cores=2)                         # doctest: +SKIP
>>> sch, db = tune_gemm_ms(GemmProblem(128, 768, 768), target, "ms_wd", 8)  # doctest: +SKIP
>>> ex = tvm.compile(sch.mod, target=target)                             # doctest: +SKIP
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from microkernels.brgemm import BrgemmShape, dispatch, zeroing
from microkernels.machine import Machine, machine_of

from .gemm import GemmConfig, GemmProblem, default_config, ranked_configs, schedule, workload
from .nest import bind_first_calls
from .space import Candidate

if TYPE_CHECKING:
    from tvm import s_tir
    from tvm.ir import IRModule
    from tvm.s_tir import meta_schedule as ms
    from tvm.target import Target

    from .remote import Tracker

__all__ = [
    "space_configs",
    "gemm_space",
    "register_intrinsics",
    "enumerate_strategy",
    "local_builder",
    "rpc_runner",
    "tune_gemm_ms",
]


def space_configs(problem: GemmProblem, machine: Machine, top_n: int = 8,
                  max_candidates: int = 400) -> list[GemmConfig]:
    """The tuner's model-ranked candidates for the default blocking, best first.

    The ``top_n`` best of :func:`schedules.gemm.ranked_configs` (the tuner's ranking of the
    default blocking's loop orders, packing included), plus the untuned default
    configuration when it is not among them (as :func:`~schedules.search.tune` does).

    Examples
    --------
    >>> from microkernels.isa import DEFAULT_CACHES, from_name
    >>> machine = Machine(from_name("avx2"), DEFAULT_CACHES, 2, fp32_flops_per_cycle=32.0)
    >>> len(space_configs(GemmProblem(96, 128, 64), machine, top_n=3)) in (3, 4)
    True
    """
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
        raise ValueError(f"top_n must be a positive int, got {top_n!r}")
    base = default_config(problem, machine)
    ranked = ranked_configs(problem, base, machine, max_candidates)
    configs = [config for _, config in ranked[:top_n]]
    if base not in configs:
        configs.append(base)
    return configs


def _as_configs(problem: GemmProblem, machine: Machine,
                candidates: Sequence[GemmConfig | Candidate] | None) -> list[GemmConfig]:
    if candidates is None:
        return space_configs(problem, machine)
    if not candidates:
        raise ValueError("candidates is empty: a design space needs at least one")
    base = default_config(problem, machine)
    configs = []
    for c in candidates:
        if isinstance(c, Candidate):
            configs.append(base.with_candidate(c))
        elif isinstance(c, GemmConfig):
            configs.append(c)
        else:
            raise TypeError(f"candidates holds GemmConfig or Candidate, got {type(c).__name__}")
    widths = {c.bn for c in configs}
    if len(widths) > 1:
        # The workload's packed-weight layout Wp[N/bn, K, bn] depends on bn: one task, one bn.
        raise ValueError(f"all candidates must share bn (the weight layout); got {sorted(widths)}")
    return configs


def register_intrinsics(configs: Sequence[GemmConfig], isa: str) -> None:
    """Register the BRGEMM intrinsics the configs' traces name (needed to replay them): each
    config's kernel and, where its implementation has them, its zeroing variants (``beta=0``
    where the call is the whole K, ``first_call_zeroes`` where K takes several calls).

    Examples
    --------
    >>> register_intrinsics([GemmConfig.of("BCa", 48, 64, 64)], "avx2")  # doctest: +SKIP
    """
    for c in configs:
        shape = BrgemmShape(m=c.bm, n=c.bn, k=c.bk, batch=c.k_step, layout="flat", isa=isa)
        for kernel in (shape, zeroing(shape), zeroing(shape, first_call_only=True)):
            if kernel is not None:
                dispatch(kernel)


def gemm_space(problem: GemmProblem, target: Target,
               candidates: Sequence[GemmConfig | Candidate] | None = None
               ) -> ms.space_generator.ScheduleFn:
    """A MetaSchedule space generator with one design space per candidate configuration.

    Parameters
    ----------
    problem
        The GEMM; the task MetaSchedule tunes must be ``workload(problem, bn)``.
    target
        A ``tpp`` target (its ``model`` names the ISA, ``num-cores`` the threads).
    candidates
        Configurations (or loop_spec candidates, given the default block sizes); default:
        :func:`space_configs`.  All must share ``bn``.  Space ``i`` is ``candidates[i]``.

    Raises
    ------
    ValueError
        Candidates with different ``bn``; a candidate the template rejects (bad spec, blocks
        that do not tile the problem) raises the template's error here, not during tuning.
    """
    from tvm.s_tir import meta_schedule as ms

    machine = machine_of(target)
    configs = _as_configs(problem, machine, candidates)
    # Scheduling each config here registers its intrinsic and catches bad configs early.
    traces = [schedule(problem, c, machine.isa).trace for c in configs]

    def design_spaces(sch: s_tir.Schedule) -> list[s_tir.Schedule]:
        spaces = []
        for trace in traces:
            space = sch.copy()
            trace.apply_to_schedule(space, remove_postproc=False)
            bind_first_calls(space)
            spaces.append(space)
        return spaces

    # No schedule rules, postprocessors or mutators: the spaces are complete schedules.
    return ms.space_generator.ScheduleFn(design_spaces, sch_rules=[], postprocs=[],
                                         mutator_probs={})


def enumerate_strategy() -> ms.search_strategy.SearchStrategy:
    """A search strategy measuring each design space once, in order (then it stops)."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.search_strategy import MeasureCandidate, PySearchStrategy

    @derived_object
    class EnumerateSpaces(PySearchStrategy):
        def __init__(self) -> None:
            self.spaces: list = []
            self.per_iter = 1
            self.next = 0

        def _initialize_with_tune_context(self, context) -> None:
            pass

        def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None,
                       cost_model=None) -> None:
            self.spaces = list(design_spaces)[:max_trials]
            self.per_iter = num_trials_per_iter
            self.next = 0

        def post_tuning(self) -> None:
            self.spaces = []

        def generate_measure_candidates(self):
            if self.next >= len(self.spaces):
                return None
            batch = self.spaces[self.next:self.next + self.per_iter]
            self.next += len(batch)
            return [MeasureCandidate(s, ArgInfo.from_entry_func(s.mod, remove_preproc=True))
                    for s in batch]

        def notify_runner_results(self, measure_candidates, results) -> None:
            pass

        def clone(self):
            return EnumerateSpaces()

    return EnumerateSpaces()


def build_module(mod: IRModule, target: Target, _params: object = None):
    """MetaSchedule's ``default_build`` minus its ``import tvm.s_tir.tensor_intrin``.

    Candidates reach the builder already scheduled (tensorized), so no intrinsic needs to be
    registered there; skipping the import saves 30-60 s per builder process.
    """
    from tvm.driver import build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    return build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target)


def local_builder(timeout_sec: float = 180.0, max_workers: int | None = None
                  ) -> ms.builder.LocalBuilder:
    """A ``LocalBuilder`` that builds with :func:`build_module` and a generous timeout.

    The default 30 s timeout kills every build of a worker still importing (the builder-timeout
    trap); 180 s leaves room for LLVM on big unrolled kernels of a loaded machine.
    """
    from tvm.s_tir import meta_schedule as ms

    if not timeout_sec >= 1:
        raise ValueError(f"timeout_sec must be >= 1, got {timeout_sec!r}")
    return ms.builder.LocalBuilder(timeout_sec=timeout_sec, max_workers=max_workers,
                                   f_build=build_module)


def rpc_runner(tracker: Tracker, servers: int = 1, session_timeout: float = 120.0
               ) -> ms.runner.RPCRunner:
    """MetaSchedule's ``RPCRunner`` on the servers under ``tracker``'s key: the baseline
    measured where :class:`~schedules.remote.RemotePool` measures the tuner's candidates,
    ``servers`` candidates at a time.

    Examples
    --------
    >>> from schedules.remote import Tracker
    >>> runner = rpc_runner(Tracker.parse("127.0.0.1:9190", "x86"), servers=2)  # doctest: +SKIP
    """
    from tvm.s_tir import meta_schedule as ms

    if servers < 1 or not session_timeout > 0:
        raise ValueError("servers must be >= 1 and session_timeout > 0")
    config = ms.runner.RPCConfig(tracker_host=tracker.host, tracker_port=tracker.port,
                                 tracker_key=tracker.key,
                                 session_timeout_sec=int(session_timeout))
    return ms.runner.RPCRunner(config, max_workers=servers)


def _set_threads(threads: int) -> None:
    # Runner workers are fresh processes: size TVM's pool before anything runs in parallel.
    os.environ["TVM_NUM_THREADS"] = str(threads)


def tune_gemm_ms(problem: GemmProblem, target: Target, work_dir: str | os.PathLike,
                 max_trials: int, *,
                 candidates: Sequence[GemmConfig | Candidate] | None = None,
                 strategy: str = "enumerate", num_trials_per_iter: int | None = None,
                 runner: object = None, seed: int = 0
                 ) -> tuple[s_tir.Schedule, ms.database.JSONDatabase]:
    """Tune ``problem`` over :func:`gemm_space` with MetaSchedule; the best schedule and the DB.

    Parameters
    ----------
    work_dir
        MetaSchedule's work directory (logs and the JSON database).
    max_trials
        Trial budget; with ``"enumerate"`` at most one trial per design space.
    strategy
        ``"enumerate"`` (:func:`enumerate_strategy`) or ``"replay-trace"``.
    num_trials_per_iter
        Candidates per builder/runner batch (default: all at once, one builder start-up).
    runner
        A MetaSchedule runner (default: a ``LocalRunner`` whose workers use the target's
        ``num-cores`` threads); :func:`rpc_runner` measures on a tracker's servers.

    Returns
    -------
    (s_tir.Schedule, JSONDatabase)
        The fastest measured schedule of ``workload(problem, bn)``, and the database.

    Raises
    ------
    ValueError
        Bad budget or strategy, a target without ``num-cores``, or candidates with mixed bn.
    RuntimeError
        No candidate built and ran.
    """
    from tvm.s_tir import meta_schedule as ms

    if isinstance(max_trials, bool) or not isinstance(max_trials, int) or max_trials < 1:
        raise ValueError(f"max_trials must be a positive int, got {max_trials!r}")
    if strategy not in ("enumerate", "replay-trace"):
        raise ValueError(f"strategy must be 'enumerate' or 'replay-trace', got {strategy!r}")
    if "num-cores" not in target.attrs:
        raise ValueError("MetaSchedule needs the target's 'num-cores'; use "
                         "tvm_tpp.target('tpp', num_cores=N)")
    machine = machine_of(target)
    configs = _as_configs(problem, machine, candidates)
    space = gemm_space(problem, target, configs)  # also registers every intrinsic
    mod = workload(problem, configs[0].bn)
    batch = num_trials_per_iter or (min(max_trials, len(configs)) if strategy == "enumerate"
                                    else max_trials)
    if runner is None:
        runner = ms.runner.LocalRunner(initializer=functools.partial(_set_threads,
                                                                     machine.threads))
    database = ms.tune_tir(
        mod=mod, target=target, work_dir=str(work_dir), max_trials_global=max_trials,
        num_trials_per_iter=batch, space=space,
        strategy=enumerate_strategy() if strategy == "enumerate" else "replay-trace",
        builder=local_builder(), runner=runner, cost_model="random", seed=seed,
    )
    best = ms.tir_integration.compile_tir(database, mod, target)
    if best is None:
        raise RuntimeError(f"MetaSchedule measured no valid candidate for {problem}; "
                           f"see the logs in {work_dir}/logs")
    bind_first_calls(best)
    return best, database
