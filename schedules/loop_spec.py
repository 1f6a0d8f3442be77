"""PARLOOPER ``loop_spec`` strings: parse, validate, and interpret them in pure Python.

A loop_spec string instantiates a set of declared *logical loops* (:class:`LoopDecl`) as a
concrete loop nest. The nest fixes three things: the loop order, how many times each loop is
blocked, and which loops run in parallel. The grammar follows [PL] §II-B and
``libxsmm/parlooper: src/par_loop_generator.cpp``::

    loop_spec ::= nest ['@' directive]
    nest      ::= item+                       (blanks are ignored)
    item      ::= letter [grid] | '|'
    letter    ::= 'a'..'z' | 'A'..'Z'         (the i-th letter names the i-th declared loop)
    grid      ::= '{' ('R' | 'C' | 'L') ':' INT '}'

Rules
-----
Order and blocking (RULE 1)
    Letters appear in nesting order, outermost first. A loop whose letter appears ``j`` times is
    blocked ``j - 1`` times. Its occurrences step by the first ``j - 1`` entries of
    ``LoopDecl.block_steps`` (outer first), and the innermost occurrence always steps by
    ``LoopDecl.step``. Occurrence ``k > 0`` ranges over ``[p, min(p + s, extent))``, where
    ``p`` is the value of occurrence ``k - 1`` and ``s`` its step. The body receives the value
    of the innermost occurrence of every loop. Every declared loop must appear at least once.
Parallel loops (RULE 2)
    An upper-case letter makes that occurrence parallel.

    - *Collapse mode* (PAR-MODE 1): parallel letters without ``{..}`` must be consecutive,
      and they form one ``collapse(k)`` group.
    - *Grid mode* (PAR-MODE 2): ``{R:n}``, ``{C:n}`` and ``{L:n}`` split that occurrence
      ``n`` ways over the rows, columns or layers of an explicit thread grid. The grid
      occurrences need not be consecutive, but then every upper-case letter needs a grid size.
Barrier and directive
    ``|`` asks for a barrier at the end of the loop level just before it. Text after ``@``
    is an OpenMP ``for`` clause such as ``schedule(dynamic, 1)``.

Mapping onto TVM (what :mod:`schedules.gemm` does with a parsed spec)
---------------------------------------------------------------------
order, blocking
    ``sch.split`` each logical loop into its occurrences. The split factors are the
    occurrences' :attr:`Occurrence.trips`, and ``None`` stands for the outermost one. Then
    ``sch.reorder`` into the nest order.
collapse(k)
    ``sch.fuse`` the group, then ``sch.parallel``. TVM's thread pool gives each thread one
    contiguous chunk of ``ceil(extent / threads)`` fused iterations. That is OpenMP's
    ``schedule(static)``. A parallel loop nested in sequential loops forks and joins once per
    outer iteration.
``{R:n}``, ``{C:n}``, ``{L:n}``
    Split that occurrence into ``n`` chunks of ``ceil(trips / n)`` iterations, as Listing 3
    assigns them. Hoist the chunk loops outermost in ``L, R, C`` order (PARLOOPER's ``tid``
    decomposition), then fuse and parallelize them as one loop of ``L*R*C`` grid cells.
    TVM hands these cells out to its pool statically. When the pool is as large as the grid,
    that is one cell per thread, exactly as in PARLOOPER.
``|``
    Recorded in :attr:`Occurrence.barrier_after`, and accepted only where TVM already
    provides it. A TVM parallel loop ends with a join, so a barrier after the collapse
    group's outermost loop, or after any loop enclosing the group, always holds. A barrier
    inside a collapse group, or inside a parallel loop, cannot be expressed. So can none
    in grid mode, except after the outermost loop. These raise :class:`LoopSpecError`.
``@ directive``
    Recorded verbatim in :attr:`LoopSpec.directive`, and allowed only in collapse mode, as in
    PARLOOPER. It is **not honoured**: TVM's pool always partitions statically, so for example
    ``schedule(dynamic, 1)`` has no effect on the generated code.
parallel reductions
    An upper-case letter on a loop declared ``reduction=True`` is rejected unless that
    :class:`LoopDecl` names a ``parallel_reduction`` strategy, which the schedule builder
    then carries out. PARLOOPER leaves such races to the user; we refuse them.

Not supported: PARLOOPER's undocumented ``[start,end,step,(blocks)]`` JIT-bound syntax. Declare
bounds in :class:`LoopDecl` instead.

Examples
--------
>>> loops = [LoopDecl("K", 4, reduction=True), LoopDecl("M", 8, block_steps=(4, 2)),
...          LoopDecl("N", 4, block_steps=(2,))]
>>> spec = parse("bcaBCb", loops)
>>> [(o.var, o.step, o.parallel) for o in spec.occurrences]  # doctest: +NORMALIZE_WHITESPACE
[('b0', 4, False), ('c0', 2, False), ('a0', 1, False), ('b1', 2, True), ('c1', 1, True),
 ('b2', 1, False)]
>>> spec.parallel_groups()
((3, 4),)
>>> len(simulate(spec)) == 4 * 8 * 4
True
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "LoopDecl",
    "Occurrence",
    "NestLoop",
    "Piece",
    "LoopSpec",
    "LoopSpecError",
    "parse",
    "simulate",
    "work_share",
]

#: Grid axes in fused order, outermost first: ``tid = (layer * R + row) * C + col``.
GRID_AXES = ("L", "R", "C")
_AXIS_NAMES = {"R": "row", "C": "col", "L": "layer"}


class LoopSpecError(ValueError):
    """A loop_spec string is malformed or does not fit the declared loops.

    Attributes
    ----------
    message
        What is wrong.
    text
        The offending loop_spec string.
    position
        Index into ``text`` of the character at fault. It may equal ``len(text)`` when the
        problem is something missing at the end.
    """

    def __init__(self, message: str, text: str, position: int) -> None:
        self.message = message
        self.text = text
        self.position = position
        super().__init__(f"{message}\n  {text}\n  {' ' * position}^")


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class LoopDecl:
    """One logical loop: ``for i in range(0, extent, step)``, optionally blocked.

    Parameters
    ----------
    name
        Human-readable name, used only in messages (the spec letter comes from the position).
    extent
        Upper bound (exclusive) of the loop, e.g. the trip count of a blocked GEMM dimension.
    step
        Stride of the innermost occurrence, e.g. ``k_step`` = the BRGEMM batch count.
    block_steps
        Steps of the outer occurrences, outer first (PARLOOPER's block list). They must nest
        perfectly: each one divides the one before it, and ``step`` divides all of them.
    reduction
        The body accumulates across this loop, so running it in parallel races.
    parallel_reduction
        The strategy that makes a parallel reduction legal, e.g. ``"rfactor"``. The parser
        only checks that one is named; the schedule builder gives it meaning.

    Examples
    --------
    >>> LoopDecl("M", 32, block_steps=(8, 2)).trips
    32
    >>> LoopDecl("M", 32, block_steps=(8, 3))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: loop 'M': block step 3 does not divide the enclosing block step 8 ...
    """

    name: str
    extent: int
    step: int = 1
    block_steps: tuple[int, ...] = ()
    reduction: bool = False
    parallel_reduction: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"loop name must be a non-empty string, got {self.name!r}")
        set_ = object.__setattr__
        set_(self, "extent", _positive_int(self.extent, f"loop {self.name!r}: extent"))
        set_(self, "step", _positive_int(self.step, f"loop {self.name!r}: step"))
        blocks = tuple(
            _positive_int(b, f"loop {self.name!r}: block step") for b in self.block_steps
        )
        set_(self, "block_steps", blocks)
        outer = None
        for b in blocks:
            if b % self.step:
                raise ValueError(
                    f"loop {self.name!r}: block step {b} is not a multiple of the step "
                    f"{self.step} (blocks must nest perfectly)"
                )
            if outer is not None and outer % b:
                raise ValueError(
                    f"loop {self.name!r}: block step {b} does not divide the enclosing block "
                    f"step {outer} (blocks must nest perfectly)"
                )
            outer = b
        if self.parallel_reduction is not None:
            if not self.reduction:
                raise ValueError(
                    f"loop {self.name!r}: parallel_reduction is only meaningful for a "
                    "reduction loop (reduction=True)"
                )
            if not isinstance(self.parallel_reduction, str) or not self.parallel_reduction:
                raise ValueError(f"loop {self.name!r}: parallel_reduction must be a non-empty str")

    @property
    def trips(self) -> int:
        """Number of body iterations of this loop: ``ceil(extent / step)``."""
        return -(-self.extent // self.step)


@dataclass(frozen=True)
class Occurrence:
    """One appearance of a loop letter in a spec, i.e. one level of the generated nest.

    ``step`` and ``span`` are ``None`` when the spec was parsed without loop declarations.
    """

    letter: str
    """Lower-case letter of the logical loop."""
    loop: int
    """Index of the logical loop (declaration order)."""
    level: int
    """0 for the loop's outermost occurrence, 1 for the next one, and so on."""
    step: int | None
    """Stride of this occurrence."""
    span: int | None
    """Length of the range it covers: the extent at level 0, otherwise the enclosing
    occurrence's step."""
    parallel: bool
    grid: tuple[str, int] | None = None
    """``(axis, ways)`` in grid mode, e.g. ``("R", 16)``."""
    barrier_after: bool = False
    position: int = field(default=0, compare=False)
    """Index of the letter in the spec text."""

    @property
    def var(self) -> str:
        """Name of the loop variable, e.g. ``"b1"`` (as in Listing 2)."""
        return f"{self.letter}{self.level}"

    @property
    def trips(self) -> int:
        """Iterations of this occurrence per iteration of its parent: ``ceil(span / step)``.

        These are the TVM split factors (the outermost one is the ``None`` factor).
        """
        if self.step is None or self.span is None:
            raise ValueError("trip counts need loop declarations (parse with LoopDecl objects)")
        return -(-self.span // self.step)


@dataclass(frozen=True)
class NestLoop:
    """One loop of the generated nest, in Listing 2's ``for v = start to stop step s`` form."""

    var: str
    occurrence: int
    start: str
    stop: str
    step: str
    pragma: str | None = None
    """Parallelization note emitted before the loop (``omp for collapse(2) nowait``, ...)."""
    barrier_after: bool = False


@dataclass(frozen=True)
class Piece:
    """A share of the iteration space that one thread executes in nest order.

    Parameters
    ----------
    ranges
        Per occurrence ``(lo, hi)``: the positions (``0 .. trips-1`` within the parent
        iteration) this share runs. Occurrences nobody partitions are ``(0, trips)``.
    ragged, points
        A collapse group whose share is not a box. ``ragged`` holds the group's occurrence
        indices, and ``points`` the position tuples to run, in order. These two override
        ``ranges`` for those occurrences.
    """

    ranges: tuple[tuple[int, int], ...]
    ragged: tuple[int, ...] = ()
    points: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class LoopSpec:
    """A parsed loop_spec: the occurrences in nest order, plus the optional directive.

    Build it with :func:`parse`. ``str(spec)`` gives the canonical text, which parses back
    to an equal object.
    """

    text: str = field(compare=False)
    occurrences: tuple[Occurrence, ...]
    directive: str | None
    loops: tuple[LoopDecl, ...] | None
    n_loops: int
    _parents: tuple[int | None, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        last: dict[int, int] = {}
        parents: list[int | None] = []
        for i, o in enumerate(self.occurrences):
            parents.append(last.get(o.loop))
            last[o.loop] = i
        object.__setattr__(self, "_parents", tuple(parents))

    def __str__(self) -> str:
        out = []
        for o in self.occurrences:
            out.append(o.letter.upper() if o.parallel else o.letter)
            if o.grid is not None:
                out.append(f"{{{o.grid[0]}:{o.grid[1]}}}")
            if o.barrier_after:
                out.append("|")
        text = "".join(out)
        return f"{text} @ {self.directive}" if self.directive is not None else text

    @property
    def mode(self) -> str:
        """``"serial"``, ``"collapse"`` (PAR-MODE 1) or ``"grid"`` (PAR-MODE 2)."""
        if any(o.grid is not None for o in self.occurrences):
            return "grid"
        return "collapse" if any(o.parallel for o in self.occurrences) else "serial"

    def parent(self, index: int) -> int | None:
        """Index of the enclosing occurrence of the same loop (``None`` at level 0)."""
        return self._parents[index]

    def occurrences_of(self, letter: str) -> tuple[Occurrence, ...]:
        """The occurrences of one loop (``"b"`` or ``"B"``), outer first."""
        letter = letter.lower()
        return tuple(o for o in self.occurrences if o.letter == letter)

    def body_indices(self) -> tuple[int, ...]:
        """For each logical loop in declaration order, the index of its innermost occurrence.

        The values of those occurrences are the body's ``ind[]`` array.
        """
        last = {o.loop: i for i, o in enumerate(self.occurrences)}
        return tuple(last[x] for x in range(self.n_loops))

    def parallel_groups(self) -> tuple[tuple[int, ...], ...]:
        """Occurrence indices that become one TVM parallel loop (empty if serial).

        Collapse mode gives the consecutive upper-case occurrences. Grid mode gives all grid
        occurrences in fused order ``L, R, C``, the order of PARLOOPER's ``tid`` decomposition.
        """
        if self.mode == "grid":
            by_axis = {o.grid[0]: i for i, o in enumerate(self.occurrences) if o.grid}
            return (tuple(by_axis[a] for a in GRID_AXES if a in by_axis),)
        group = tuple(i for i, o in enumerate(self.occurrences) if o.parallel)
        return (group,) if group else ()

    def grid_shape(self) -> tuple[int, int, int] | None:
        """``(L, R, C)`` team counts in grid mode (missing axes are 1), else ``None``."""
        if self.mode != "grid":
            return None
        ways = {o.grid[0]: o.grid[1] for o in self.occurrences if o.grid}
        return tuple(ways.get(a, 1) for a in GRID_AXES)  # type: ignore[return-value]

    def values(self, index: int, env: Sequence[int], lo: int = 0, hi: int | None = None) -> range:
        """Values taken by occurrence ``index`` at positions ``[lo, hi)``.

        ``env[j]`` must hold the current value of every enclosing occurrence ``j``. Values
        that the clamp to the loop's extent cuts off are left out.
        """
        o = self.occurrences[index]
        decl = self._decl(o)
        p = self._parents[index]
        if p is None:
            base, bound = 0, decl.extent
        else:
            base = env[p]
            bound = min(base + o.span, decl.extent)
        hi = o.trips if hi is None else min(hi, o.trips)
        start = base + lo * o.step
        return range(start, max(start, min(base + hi * o.step, bound)), o.step)

    def nest(self) -> tuple[NestLoop, ...]:
        """The generated loop nest as data, outermost first (cf. Listings 2 and 3).

        Bounds are numbers when loops were declared, and symbolic (``b.extent``,
        ``b.block[0]``, ``b.step``) otherwise. A bound is wrapped in ``min(.., extent)`` only
        when the block can overrun the extent.
        """
        groups = self.parallel_groups()
        first = groups[0][0] if groups and self.mode == "collapse" else None
        out = []
        for i, o in enumerate(self.occurrences):
            decl = None if self.loops is None else self.loops[o.loop]
            p = self._parents[i]
            if decl is None:
                step = f"{o.letter}.step" if o.level == len(self.occurrences_of(o.letter)) - 1 \
                    else f"{o.letter}.block[{o.level}]"
                start = "0" if p is None else self.occurrences[p].var
                stop = f"{o.letter}.extent" if p is None \
                    else f"{start} + {o.letter}.block[{o.level - 1}]"
            else:
                step = str(o.step)
                start = "0" if p is None else self.occurrences[p].var
                if p is None:
                    stop = str(decl.extent)
                elif decl.extent % o.span == 0:
                    stop = f"{start} + {o.span}"
                else:
                    stop = f"min({start} + {o.span}, {decl.extent})"
            pragma = None
            if i == first:
                k = len(groups[0])
                clause = f" collapse({k})" if k > 1 else ""
                extra = f" {self.directive}" if self.directive else ""
                pragma = f"omp for{clause}{extra} nowait"
            elif o.grid is not None:
                pragma = f"split {o.grid[1]} ways over {_AXIS_NAMES[o.grid[0]]} teams"
            out.append(NestLoop(o.var, i, start, stop, step, pragma, o.barrier_after))
        return tuple(out)

    def pseudocode(self) -> str:
        """The nest rendered as indented pseudocode, in the style of Listing 2."""
        lines, pad = [], ""
        if self.mode != "serial":
            lines.append("parallel region:")
            if self.mode == "grid":
                lyr, row, col = self.grid_shape()  # type: ignore[misc]
                lines.append(f"  grid {lyr}x{row}x{col} (layers x rows x cols)")
            pad = "  "
        loops = self.nest()
        for depth, n in enumerate(loops):
            ind = pad + "  " * depth
            if n.pragma:
                lines.append(f"{ind}# {n.pragma}")
            lines.append(f"{ind}for {n.var} = {n.start} to {n.stop} step {n.step}")
        body = ", ".join(self.occurrences[i].var for i in self.body_indices())
        lines.append(f"{pad}{'  ' * len(loops)}body({body})")
        for depth in range(len(loops) - 1, -1, -1):
            if loops[depth].barrier_after:
                lines.append(f"{pad}{'  ' * depth}barrier  # end of {loops[depth].var}")
        return "\n".join(lines)

    def _decl(self, o: Occurrence) -> LoopDecl:
        if self.loops is None:
            raise ValueError("this operation needs loop declarations (parse with LoopDecl objects)")
        return self.loops[o.loop]


# --------------------------------------------------------------------------------------------
# Parser


@dataclass
class _Item:
    letter: str
    loop: int
    parallel: bool
    position: int
    grid: tuple[str, int] | None = None
    grid_position: int = -1
    barrier_position: int = -1


def _parse_grid(text: str, i: int) -> tuple[str, int, int, int]:
    """Parse ``{X:n}`` starting at ``text[i] == '{'``: (axis, n, axis position, next index)."""
    j = i + 1
    while j < len(text) and text[j].isspace():
        j += 1
    if j >= len(text) or text[j].upper() not in _AXIS_NAMES:
        raise LoopSpecError("expected a grid axis R, C or L after '{'", text, j)
    axis, axis_pos = text[j].upper(), j
    j += 1
    while j < len(text) and text[j].isspace():
        j += 1
    if j >= len(text) or text[j] != ":":
        raise LoopSpecError(f"expected ':' after grid axis {axis!r}", text, j)
    j += 1
    while j < len(text) and text[j].isspace():
        j += 1
    k = j
    while k < len(text) and text[k].isdigit():
        k += 1
    if k == j:
        raise LoopSpecError("expected the number of teams after ':'", text, j)
    ways = int(text[j:k])
    if ways < 1:
        raise LoopSpecError(f"a grid axis needs at least 1 team, got {ways}", text, j)
    while k < len(text) and text[k].isspace():
        k += 1
    if k >= len(text) or text[k] != "}":
        raise LoopSpecError("expected '}' to close the grid size", text, k)
    return axis, ways, axis_pos, k + 1


def parse(spec: str, loops: Sequence[LoopDecl] | int) -> LoopSpec:
    """Parse and validate a loop_spec string against the declared logical loops.

    Parameters
    ----------
    spec
        The loop_spec string, e.g. ``"bcaBCb @ schedule(dynamic, 1)"``.
    loops
        The logical loops in declaration order (letter ``a`` is ``loops[0]``). Alternatively,
        just their number: then only the syntax is checked, and steps stay unknown.

    Returns
    -------
    LoopSpec

    Raises
    ------
    LoopSpecError
        Malformed text, or text that does not fit ``loops``. The message ends with the string
        and a caret under the offending character.
    TypeError
        ``spec`` is not a string, or ``loops`` is neither declarations nor an int.

    Examples
    --------
    >>> str(parse("bc | aBCb @schedule(dynamic,1)", 3))
    'bc|aBCb @ schedule(dynamic,1)'
    >>> parse("abd", 3)
    Traceback (most recent call last):
    ...
    schedules.loop_spec.LoopSpecError: letter 'd' names loop 4 but only 3 loops are declared (a..c)
      abd
        ^
    """
    if not isinstance(spec, str):
        raise TypeError(f"loop_spec must be a str, got {type(spec).__name__}")
    decls: tuple[LoopDecl, ...] | None
    if isinstance(loops, numbers.Integral) and not isinstance(loops, bool):
        decls, n_loops = None, int(loops)
    elif isinstance(loops, Sequence) and all(isinstance(d, LoopDecl) for d in loops):
        decls, n_loops = tuple(loops), len(loops)
    else:
        raise TypeError("loops must be a sequence of LoopDecl or the number of loops")
    if not 1 <= n_loops <= 26:
        raise ValueError(f"between 1 and 26 logical loops can be declared, got {n_loops}")

    at = spec.find("@")
    body_end = len(spec) if at < 0 else at
    directive = None
    if at >= 0:
        directive = spec[at + 1:].strip()
        if not directive:
            raise LoopSpecError("empty directive after '@'", spec, at)

    items: list[_Item] = []
    counts = [0] * n_loops
    i = 0
    while i < body_end:
        ch = spec[i]
        if ch.isspace():
            i += 1
        elif ch.isascii() and ch.isalpha():
            x = ord(ch.lower()) - ord("a")
            if x >= n_loops:
                raise LoopSpecError(
                    f"letter {ch!r} names loop {x + 1} but only {n_loops} loops are declared "
                    f"(a..{chr(ord('a') + n_loops - 1)})", spec, i)
            counts[x] += 1
            if decls is not None and counts[x] > len(decls[x].block_steps) + 1:
                raise LoopSpecError(
                    f"loop {ch.lower()!r} ({decls[x].name}) appears {counts[x]} times but "
                    f"declares {len(decls[x].block_steps)} block steps (a loop appearing j "
                    "times needs j-1 block steps)", spec, i)
            parallel = ch.isupper()
            if parallel and decls is not None and decls[x].reduction \
                    and decls[x].parallel_reduction is None:
                raise LoopSpecError(
                    f"loop {ch.lower()!r} ({decls[x].name}) is a reduction: running it in "
                    "parallel races unless its LoopDecl names a parallel_reduction strategy",
                    spec, i)
            items.append(_Item(ch.lower(), x, parallel, i))
            i += 1
        elif ch == "{":
            prev = items[-1] if items else None
            if prev is None or prev.barrier_position >= 0 or prev.grid is not None:
                raise LoopSpecError("a grid size '{..}' must directly follow a loop letter",
                                    spec, i)
            if not prev.parallel:
                raise LoopSpecError(
                    f"grid size on sequential loop {prev.letter!r}: only upper-case "
                    "(parallel) letters take {R:n}, {C:n} or {L:n}", spec, i)
            axis, ways, axis_pos, i = _parse_grid(spec[:body_end], i)
            for other in items:
                if other.grid is not None and other.grid[0] == axis:
                    raise LoopSpecError(
                        f"grid axis {axis} is already used by loop {other.letter.upper()!r}",
                        spec, axis_pos)
            prev.grid, prev.grid_position = (axis, ways), axis_pos
        elif ch == "|":
            prev = items[-1] if items else None
            if prev is None:
                raise LoopSpecError("'|' (barrier) must follow a loop letter", spec, i)
            if prev.barrier_position >= 0:
                raise LoopSpecError("duplicate barrier '|' for the same loop level", spec, i)
            prev.barrier_position = i
            i += 1
        elif ch == "[":
            raise LoopSpecError(
                "PARLOOPER's '[start,end,step,(blocks)]' JIT bounds are not supported; "
                "declare bounds in LoopDecl", spec, i)
        else:
            raise LoopSpecError(f"unexpected character {ch!r}", spec, i)

    if not items:
        raise LoopSpecError("empty loop_spec: name at least one loop", spec, 0)
    end = len(spec[:body_end].rstrip())
    for x, c in enumerate(counts):
        if c == 0:
            name = f" ({decls[x].name})" if decls is not None else ""
            raise LoopSpecError(
                f"loop {chr(ord('a') + x)!r}{name} never appears; every declared loop must "
                "appear at least once", spec, end)

    _check_parallel(spec, items, directive, at)

    occurrences = []
    seen = [0] * n_loops
    for it in items:
        level = seen[it.loop]
        seen[it.loop] += 1
        step = span = None
        if decls is not None:
            d = decls[it.loop]
            chain = d.block_steps[:counts[it.loop] - 1] + (d.step,)
            step = chain[level]
            span = d.extent if level == 0 else chain[level - 1]
        occurrences.append(Occurrence(it.letter, it.loop, level, step, span, it.parallel,
                                      it.grid, it.barrier_position >= 0, it.position))
    return LoopSpec(spec, tuple(occurrences), directive, decls, n_loops)


def _check_parallel(spec: str, items: list[_Item], directive: str | None, at: int) -> None:
    """Validate the parallel letters, barriers and directive (RULE 2)."""
    parallel = [k for k, it in enumerate(items) if it.parallel]
    grid = any(it.grid is not None for it in items)
    if grid:
        for k in parallel:
            if items[k].grid is None:
                raise LoopSpecError(
                    f"parallel loop {items[k].letter.upper()!r} has no grid size: in grid mode "
                    "every upper-case letter needs {R:n}, {C:n} or {L:n}", spec,
                    items[k].position)
        if directive is not None:
            raise LoopSpecError("an '@' directive applies only to collapse-mode (no {..}) "
                                "parallel loops", spec, at)
        for k, it in enumerate(items):
            if it.barrier_position >= 0 and k > 0:
                raise LoopSpecError(
                    "grid mode runs each grid cell as an independent task, so a barrier can "
                    "only follow the outermost loop", spec, it.barrier_position)
        return
    if directive is not None and not parallel:
        raise LoopSpecError("an '@' directive needs a parallel (upper-case) loop", spec, at)
    if not parallel:
        return
    for a, b in zip(parallel, parallel[1:], strict=False):
        if b != a + 1:
            raise LoopSpecError(
                "upper-case letters must be consecutive (one collapse group) unless each "
                "carries a grid size {R:n}/{C:n}/{L:n}", spec, items[b].position)
    for k, it in enumerate(items):
        if it.barrier_position >= 0 and k > parallel[0]:
            raise LoopSpecError(
                "a barrier inside a parallel loop cannot be expressed in TVM; place it after "
                "the outermost parallel loop or an enclosing loop", spec, it.barrier_position)


# --------------------------------------------------------------------------------------------
# Work partition and interpretation


def _digits(index: int, radix: Sequence[int]) -> list[int]:
    out = []
    for r in reversed(radix):
        index, d = divmod(index, r)
        out.append(d)
    return out[::-1]


def _chunk(n: int, parts: int, part: int) -> tuple[int, int]:
    size = -(-n // parts)
    return min(part * size, n), min((part + 1) * size, n)


def work_share(spec: LoopSpec, thread: int, threads: int) -> tuple[Piece, ...]:
    """What ``thread`` of ``threads`` executes, under TVM's static partition.

    Serial spec
        Thread 0 runs everything.
    Collapse mode
        The fused group, of ``prod(trips)`` iterations including clamped-off ones, is cut
        into contiguous chunks of ``ceil(total / threads)``.
    Grid mode
        The ``L*R*C`` cells are dealt out to the threads in contiguous chunks. Inside a cell,
        a grid occurrence of ``n`` ways gives team ``id`` the positions
        ``[id*ceil(trips/n), (id+1)*ceil(trips/n))`` (Listing 3).

    Returns an empty tuple for an idle thread.
    """
    threads = _positive_int(threads, "threads")
    if not 0 <= thread < threads:
        raise ValueError(f"thread must be in [0, {threads}), got {thread}")
    full = [(0, o.trips) for o in spec.occurrences]
    mode = spec.mode
    if mode == "serial":
        return (Piece(tuple(full)),) if thread == 0 else ()
    (group,) = spec.parallel_groups()
    if mode == "collapse":
        radix = [spec.occurrences[i].trips for i in group]
        s, e = _chunk(math.prod(radix), threads, thread)
        if s >= e:
            return ()
        ds, de = _digits(s, radix), _digits(e - 1, radix)
        q = next((k for k in range(len(radix)) if ds[k] != de[k]), len(radix) - 1)
        if all(ds[r] == 0 and de[r] == radix[r] - 1 for r in range(q + 1, len(radix))):
            for k, i in enumerate(group):
                full[i] = (ds[k], de[k] + 1) if k <= q else (0, radix[k])
            return (Piece(tuple(full)),)
        points = tuple(tuple(_digits(n, radix)) for n in range(s, e))
        return (Piece(tuple(full), tuple(group), points),)
    shape = spec.grid_shape()
    assert shape is not None
    rows, cols = shape[1], shape[2]
    first, last = _chunk(math.prod(shape), threads, thread)
    pieces = []
    for cell in range(first, last):
        team = {"L": cell // (rows * cols), "R": cell // cols % rows, "C": cell % cols}
        ranges = list(full)
        for i in group:
            axis, ways = spec.occurrences[i].grid  # type: ignore[misc]
            ranges[i] = _chunk(spec.occurrences[i].trips, ways, team[axis])
        if all(lo < hi for lo, hi in ranges):
            pieces.append(Piece(tuple(ranges)))
    return tuple(pieces)


def _bodies(spec: LoopSpec, piece: Piece, out: list[tuple[int, ...]]) -> None:
    """Append the body index tuples of one piece to ``out``, in execution order."""
    depth = len(spec.occurrences)
    body = spec.body_indices()
    env = [0] * depth
    ragged_at = piece.ragged[0] if piece.ragged else -1
    last = depth - 1

    def run(i: int) -> None:
        if i == ragged_at:
            for point in piece.points:
                for m, pos in zip(piece.ragged, point, strict=True):
                    r = spec.values(m, env, pos, pos + 1)
                    if not r:
                        break
                    env[m] = r[0]
                else:
                    if i + len(piece.ragged) == depth:
                        out.append(tuple(env[j] for j in body))
                    else:
                        run(i + len(piece.ragged))
            return
        lo, hi = piece.ranges[i]
        values = spec.values(i, env, lo, hi)
        if i < last:
            for v in values:
                env[i] = v
                run(i + 1)
            return
        # Innermost level: only its own entry of the body tuple changes.
        k = body.index(i)
        head = [env[j] for j in body]
        for v in values:
            head[k] = v
            out.append(tuple(head))

    run(0)


def simulate(
    spec: LoopSpec | str,
    loops: Sequence[LoopDecl] | None = None,
    *,
    threads: int = 1,
    thread: int | None = None,
) -> list[tuple[int, ...]]:
    """Run the nest in pure Python and return the body index tuples in execution order.

    Each tuple holds the logical indices in declaration order, like PARLOOPER's ``ind[]``.

    Parameters
    ----------
    spec
        A parsed spec, or a string to parse against ``loops``.
    threads
        Size of the thread pool the work is partitioned over (see :func:`work_share`).
    thread
        Return only this thread's bodies. By default all threads' bodies are concatenated in
        thread order, each in its own execution order. In grid mode a thread runs its cells
        one after another.

    Examples
    --------
    >>> loops = [LoopDecl("M", 4, block_steps=(2,)), LoopDecl("N", 2)]
    >>> simulate("aba", loops)
    [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    >>> simulate("aBa", loops, threads=2, thread=1)
    [(0, 1), (1, 1), (2, 1), (3, 1)]
    """
    if isinstance(spec, str):
        if loops is None:
            raise ValueError("pass the loop declarations to simulate a spec string")
        spec = parse(spec, loops)
    spec._decl(spec.occurrences[0])  # fail early without declarations
    out: list[tuple[int, ...]] = []
    for t in range(threads) if thread is None else [thread]:
        for piece in work_share(spec, t, threads):
            _bodies(spec, piece, out)
    return out
