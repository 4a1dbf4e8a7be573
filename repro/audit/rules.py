"""The upstream fixes vllm-audit knows, and the rules that find each one in source text.

Each fix is judged by a rule that looks inside the body of one named function (parsed with
``ast``, line numbers those of the real file), with a resolver for sibling methods so a fix
factored into a helper still counts, and for the functions of the other files the fix names
(``Fix.also``: the worker that calls the runner, the class a method delegates to). Knowledge of
fixes lives in ``FIXES`` only: adding a fix is adding one ``Fix`` entry with its rule. Where the
text comes from (a directory, a wheel, an sdist, the installed package) is repro.audit.scan's
concern, not this module's.

A rule says ``unknown`` when the source has a shape it cannot judge (a call into code it cannot
read, no recognisable capture), and its evidence says what it could not see: an unknown is
never reported as present or absent.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal


class State(StrEnum):
    """What the audit found of one fix (its JSON "state" is the value)."""

    PRESENT = "present"
    ABSENT = "absent"
    NOT_APPLICABLE = "not-applicable"
    UNKNOWN = "unknown"  # a shape the rule cannot judge; the evidence says what it lacks


# The rules below say these often; the short names are the members themselves.
PRESENT, ABSENT, NOT_APPLICABLE, UNKNOWN = State.PRESENT, State.ABSENT, State.NOT_APPLICABLE, State.UNKNOWN

PWAL = "process_weights_after_loading"

# What ast.parse raises on text it cannot take: bad syntax, NUL bytes (ValueError before
# Python 3.12), absurd nesting.
UNPARSABLE = (SyntaxError, ValueError, RecursionError)


class AuditError(Exception):
    """The source cannot be audited; the message is one sentence naming path and remedy."""


# --------------------------------------------------------------------------- results


@dataclass
class FixCheck:
    fix_id: str
    title: str
    state: State
    file: str  # path inside the package tree, e.g. vllm/model_executor/...
    line: int | None  # 1-based line of the evidence in that file
    evidence: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class RuleVerdict:
    """What a rule concluded about one function body (not a finding of a trial: repro.outcome.Finding)."""

    state: State
    line: int | None
    evidence: str
    file: str | None = None  # where `line` is, when the evidence is in one of Fix.also


# A rule sees the function's AST (line numbers are those of the real file) and a Resolver:
# sibling methods of the same class first, so a fix factored into a helper still counts, then
# the functions of the fix's other files.
AstRule = Callable[[ast.FunctionDef, "Resolver"], RuleVerdict]


@dataclass(frozen=True)
class Fix:
    fix_id: str  # upstream PR number, without '#'
    title: str
    file: str  # path inside the package tree ("vllm/...")
    function: str  # the function/method whose body carries the fix
    rule: AstRule
    url: str = ""
    also: tuple[str, ...] = ()  # other files the rule reads (absent ones read as None)


def self_attr(node: ast.AST) -> str | None:
    """'x' for ``self.x`` or ``getattr(self, "x"[, default])``, else None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[0], ast.Name)
        and node.args[0].id == "self"
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    return None


def identifiers(node: ast.AST) -> set[str]:
    """Every Name id and attribute name mentioned anywhere in the expression."""
    found: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            found.add(n.id)
        elif isinstance(n, ast.Attribute):
            found.add(n.attr)
    return found


def short(node: ast.AST, limit: int = 70) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def position(node: ast.AST) -> tuple[int, int]:
    return (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))


def walk_in_order(fn: ast.AST) -> list[ast.AST]:
    # ast.walk is breadth-first; the rules reason about source order.
    return sorted((n for n in ast.walk(fn) if hasattr(n, "lineno")), key=position)


def assignments(fn: ast.AST) -> Iterator[tuple[ast.stmt, ast.expr, ast.expr]]:
    """(statement, target, value) for plain and annotated assignments with a value."""
    for node in walk_in_order(fn):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                yield node, target, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            yield node, node.target, node.value


def is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


# -- #43909: the gathered lm_head is cached on the module ------------------------------

WEIGHTY = ("weight", "lm_head", "gather")


def weight_locals(fn: ast.AST) -> set[str]:
    """Local names that hold the lm_head weight or something derived from it.

    A tiny taint pass, iterated to a fixpoint so the order of branches does not matter.
    """
    tainted: set[str] = set()
    changed = True
    while changed:
        changed = False
        for _, target, value in assignments(fn):
            if not isinstance(target, ast.Name) or target.id in tainted:
                continue
            ids = identifiers(value)
            if ids & tainted or any(w in i.lower() for i in ids for w in WEIGHTY):
                tainted.add(target.id)
                changed = True
    return tainted


def self_reads(fn: ast.AST) -> dict[str, int]:
    """First line at which each ``self.<attr>`` is read in the function."""
    reads: dict[str, int] = {}
    for node in walk_in_order(fn):
        attr = None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            attr = self_attr(node)
        elif isinstance(node, ast.Call):
            attr = self_attr(node)  # getattr(self, "x", None)
        if attr is not None:
            reads.setdefault(attr, node.lineno)
    return reads


def first_gather(fn: ast.AST) -> ast.Call | None:
    for node in walk_in_order(fn):
        if isinstance(node, ast.Call) and "gather" in short(node.func, 200).lower():
            return node
    return None


def rule_cached_gather(fn: ast.FunctionDef, resolve: Callable[[str], Any]) -> RuleVerdict:
    tainted = weight_locals(fn)
    reads = self_reads(fn)
    writes = []
    for stmt, target, value in assignments(fn):
        attr = self_attr(target)
        if attr is None or is_none(value):
            continue  # `self.x = None` is a reset, not a cache fill
        ids = identifiers(value)
        if ids & tainted or any(w in i.lower() for i in ids for w in WEIGHTY):
            writes.append((stmt, attr, value))
    for stmt, attr, value in writes:
        if attr in reads:
            return RuleVerdict(
                PRESENT,
                stmt.lineno,
                f"self.{attr} = {short(value)} at line {stmt.lineno}, read back at line {reads[attr]}",
            )
    if writes:
        stmt, attr, _ = writes[0]
        return RuleVerdict(
            ABSENT,
            stmt.lineno,
            f"self.{attr} is written at line {stmt.lineno} but never read back "
            f"in {fn.name}, so it is not used as a cache",
        )
    gather = first_gather(fn)
    if gather is not None:
        return RuleVerdict(
            ABSENT,
            gather.lineno,
            f"{short(gather.func)}(...) at line {gather.lineno} goes into a local "
            f"only; no self.<attr> cache in {fn.name}",
        )
    return RuleVerdict(ABSENT, fn.lineno, f"{fn.name} stores no gathered weight on self (no all-gather found either)")


# -- #50074: the MoE kernel is built only once -------------------------------------------


def block_fields(stmt: ast.stmt) -> list[list[ast.stmt]]:
    blocks = [
        getattr(stmt, name) for name in ("body", "orelse", "finalbody") if isinstance(getattr(stmt, name, None), list)
    ]
    blocks += [h.body for h in getattr(stmt, "handlers", [])]
    blocks += [case.body for case in getattr(stmt, "cases", [])]
    return blocks


def contains(tree: ast.AST, target: ast.AST) -> bool:
    return any(n is target for n in ast.walk(tree))


def always_exits(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], (ast.Return, ast.Raise))


def conditions_for(body: list[ast.stmt], target: ast.AST) -> list[tuple[ast.expr, bool]]:
    """Tests that hold whenever `target` runs: (test, True) inside an if-branch,
    (test, False) inside its else-branch or after an `if test: return` early exit."""
    for i, stmt in enumerate(body):
        if not contains(stmt, target):
            continue
        held = [(s.test, False) for s in body[:i] if isinstance(s, ast.If) and not s.orelse and always_exits(s.body)]
        if stmt is target:
            return held
        if isinstance(stmt, ast.If):
            in_body = any(contains(s, target) for s in stmt.body)
            branch = stmt.body if in_body else stmt.orelse
            return held + [(stmt.test, in_body)] + conditions_for(branch, target)
        for block in block_fields(stmt):
            if any(contains(s, target) for s in block):
                return held + conditions_for(block, target)
        return held
    return []


def tests_unset(test: ast.expr, holds: bool, attr: str) -> bool:
    """Does `test` evaluating to `holds` imply that self.<attr> is unset (None)?"""
    if isinstance(test, ast.BoolOp):
        # `a and b` true => each true; `a or b` false => each false.
        if (isinstance(test.op, ast.And) and holds) or (isinstance(test.op, ast.Or) and not holds):
            return any(tests_unset(v, holds, attr) for v in test.values)
        return False
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return tests_unset(test.operand, not holds, attr)
    if self_attr(test) == attr:
        return not holds  # `if not self.k` / `else` of `if self.k`
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, right = test.left, test.comparators[0]
        if is_none(left):
            left, right = right, left
        if self_attr(left) != attr or not is_none(right):
            return False
        op = test.ops[0]
        if isinstance(op, (ast.Is, ast.Eq)):
            return holds
        if isinstance(op, (ast.IsNot, ast.NotEq)):
            return not holds
    return False


def kernel_builds(fn: ast.AST) -> list[tuple[ast.stmt, str, ast.expr]]:
    """`self.<...kernel...> = <call>` statements: the construction of a kernel object."""
    return [
        (stmt, attr, value)
        for stmt, target, value in assignments(fn)
        if (attr := self_attr(target)) is not None and "kernel" in attr.lower() and isinstance(value, ast.Call)
    ]


def rule_kernel_built_once(fn: ast.FunctionDef, resolve: Callable[[str], Any]) -> RuleVerdict:
    builds = kernel_builds(fn)
    if not builds:
        return RuleVerdict(
            ABSENT,
            fn.lineno,
            f"no self.<kernel> = <call> construction found in {fn.name}; cannot see a kernel being built",
        )
    guarded = []
    for stmt, attr, value in builds:
        guard = next((test for test, holds in conditions_for(fn.body, stmt) if tests_unset(test, holds, attr)), None)
        if guard is None:
            return RuleVerdict(
                ABSENT,
                stmt.lineno,
                f"self.{attr} = {short(value.func)}(...) at line {stmt.lineno} runs on every call (no `is None` guard)",
            )
        guarded.append((stmt, attr, value, guard))
    stmt, attr, value, guard = guarded[0]
    return RuleVerdict(
        PRESENT,
        stmt.lineno,
        f"self.{attr} = {short(value.func)}(...) at line {stmt.lineno} guarded by "
        f"`{short(guard)}` (line {guard.lineno})",
    )


# -- #57954: the reused config's alphas are refreshed before expert PWAL ------------------

ALPHAS = ("g1_alphas", "g2_alphas")


def alias_map(fn: ast.AST) -> dict[str, set[str]]:
    """Local name -> identifiers of what it was bound to (`g1 = cfg.g1_alphas`)."""
    aliases: dict[str, set[str]] = {}
    for _, target, value in assignments(fn):
        if isinstance(target, ast.Name):
            aliases.setdefault(target.id, set()).update(identifiers(value))
    return aliases


def refers_to(node: ast.AST, name: str, aliases: dict[str, set[str]]) -> bool:
    ids = identifiers(node)
    return name in ids or any(name in aliases.get(i, ()) for i in ids)


def alpha_writes(fn: ast.AST, alpha: str) -> list[tuple[ast.AST, str]]:
    """In-place writes into the config alpha: `<..alpha>.copy_(x)`,
    `torch.Tensor.copy_(<..alpha>, x)`, `<..alpha>[...] = x`."""
    aliases = alias_map(fn)
    found: list[tuple[ast.AST, str]] = []
    for node in walk_in_order(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "copy_":
            receiver = node.func.value
            if refers_to(receiver, alpha, aliases) and node.args:
                found.append((node, f"{short(receiver, 50)}.copy_({short(node.args[0], 40)})"))
            elif node.args and refers_to(node.args[0], alpha, aliases):
                found.append((node, short(node, 90)))
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Subscript) and refers_to(t.value, alpha, aliases) for t in node.targets
        ):
            found.append((node, short(node, 90)))
    return found


def self_method_calls(fn: ast.AST) -> list[tuple[ast.Call, str]]:
    return [
        (n, n.func.attr)
        for n in walk_in_order(fn)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "self"
    ]


def alpha_refreshes(
    fn: ast.FunctionDef, resolve: Callable[[str], Any], alpha: str
) -> list[tuple[tuple[int, int], int, str]]:
    """(position in fn, line, description) of each write into `alpha`, including writes
    made one call deep in a sibling method, positioned at the call site."""
    hits = [(position(n), n.lineno, text) for n, text in alpha_writes(fn, alpha)]
    for call, name in self_method_calls(fn):
        helper = resolve(name)
        if helper is None or helper is fn or name == PWAL:
            continue
        for n, text in alpha_writes(helper, alpha):
            hits.append((position(call), n.lineno, f"{text} in self.{name}() called at line {call.lineno}"))
    return sorted(hits)


def pwal_calls(fn: ast.AST) -> list[ast.Call]:
    calls = [
        n
        for n in walk_in_order(fn)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == PWAL
    ]
    # Prefer the expert-level call the fix is about; fall back to any PWAL call.
    experts = [c for c in calls if "fused_experts" in identifiers(c.func)]
    return experts or calls


def rule_alphas_refreshed(fn: ast.FunctionDef, resolve: Callable[[str], Any]) -> RuleVerdict:
    pwals = pwal_calls(fn)
    if not pwals:
        return RuleVerdict(
            ABSENT, fn.lineno, f"no {PWAL}(...) call in {fn.name}; cannot place an alpha refresh before it"
        )
    last = pwals[-1]
    where = f"{short(last.func)}(...) at line {last.lineno}"
    before, late = [], []
    for alpha in ALPHAS:
        hits = alpha_refreshes(fn, resolve, alpha)
        early = [h for h in hits if h[0] < position(last)]
        if early:
            before.append(early[0])
        elif hits:
            late.append((alpha, hits[0]))
        else:
            late.append((alpha, None))
    if not late:
        described = "; ".join(f"{text} (line {line})" for _, line, text in before)
        return RuleVerdict(PRESENT, before[0][1], f"{described} before {where}")
    missing = [alpha for alpha, hit in late if hit is None]
    after = [(alpha, hit) for alpha, hit in late if hit is not None]
    if after:
        alpha, (_, line, text) = after[0]
        return RuleVerdict(
            ABSENT, line, f"{text} at line {line} comes after {where}: expert post-processing still sees the old alphas"
        )
    if before:
        return RuleVerdict(
            ABSENT,
            before[0][1],
            f"only {before[0][2]} (line {before[0][1]}) before {where}; {', '.join(missing)} not refreshed",
        )
    return RuleVerdict(ABSENT, last.lineno, f"no in-place refresh of {' / '.join(ALPHAS)} before {where}")


# -- shared by the Model Runner V2 rules -------------------------------------------------------

V2_RUNNER = "vllm/v1/worker/gpu/model_runner.py"
V2_BLOCK_TABLE = "vllm/v1/worker/gpu/block_table.py"
GPU_WORKER = "vllm/v1/worker/gpu_worker.py"  # one Worker drives the V1 and the V2 runner


def call_name(call: ast.Call) -> str | None:
    """'m' for ``m(...)``, ``x.m(...)`` and ``self.a.m(...)``."""
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def calls_in(fn: ast.AST) -> list[ast.Call]:
    return [n for n in walk_in_order(fn) if isinstance(n, ast.Call)]


def self_rooted(node: ast.AST) -> bool:
    """``self.a``, ``self.a.b``, ``self.a[i].b``: an expression reached from self."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "self"


def first_def(resolve: Resolver, file: str, name: str) -> ast.FunctionDef | None:
    found = resolve.defined(file, name)
    return found[0] if found else None


# -- #55341: Model Runner V2 locks the workspace after CUDA-graph capture --------------------
#
# vLLM #55336: the V2 runner never locked the WorkspaceManager, so a workspace request larger
# than the arena after capture (the V2 kernel warmup ran after capture) grew it by replacing
# the arena tensor (`del`, `empty_cache()`, `torch.empty(...)`), freeing the buffer the
# captured graphs had baked in: an illegal memory access at start-up. The V1 runner calls
# `lock_workspace()` at the end of `capture_model()`, which turns such a growth into an
# AssertionError. The fix (#55341) moved the V2 warmup before capture, and the V2
# `capture_model()` now ends with the same lock: the lock is what this rule looks for, since it
# is what makes any later growth raise instead of freeing graph memory. An open follow-up
# (#46883) moves the lock to the end of `Worker.compile_or_warm_up_model()`, which this rule
# accepts too. A lock after capture does not cover a growth *between* two captures (vLLM
# #45670/#46067: ascending capture sizes); no rule here judges that.

CAPTURE_CALL = re.compile(r"^_?capture(_\w+)?$")  # capture(), _capture_cudagraphs(), ...


def capture_calls(fn: ast.AST) -> list[ast.Call]:
    return [c for c in calls_in(fn) if (name := call_name(c)) and name != "capture_model" and CAPTURE_CALL.match(name)]


def is_workspace_lock(call: ast.Call) -> bool:
    """``lock_workspace()``, or ``<...workspace...>.lock()`` (the manager's own method)."""
    name = call_name(call)
    if name == "lock_workspace":
        return True
    return (
        name == "lock"
        and isinstance(call.func, ast.Attribute)
        and any("workspace" in i.lower() for i in identifiers(call.func.value))
    )


def locks_after(
    fn: ast.AST, after: tuple[int, int], lookup: Callable[[str], ast.FunctionDef | None]
) -> list[tuple[ast.Call, str]]:
    """Workspace locks that run after `after` in fn: direct calls, and those one call deep
    in a method fn calls after it (the lock factored into a helper), described at the call."""
    found = []
    for call in calls_in(fn):
        if position(call) <= after:
            continue
        if is_workspace_lock(call):
            found.append((call, f"{short(call.func)}() at line {call.lineno}"))
        elif (
            isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "self"
        ):
            helper = lookup(call.func.attr)
            if helper is not None and helper is not fn:
                lock = next((c for c in calls_in(helper) if is_workspace_lock(c)), None)
                if lock is not None:
                    found.append(
                        (call, f"{short(lock.func)}() in self.{call.func.attr}() called at line {call.lineno}")
                    )
    return found


def unread_self_calls(
    fn: ast.AST, after: tuple[int, int], lookup: Callable[[str], ast.FunctionDef | None]
) -> list[ast.Call]:
    """``self.m()`` calls after `after` whose method is in none of the files read."""
    return [
        c
        for c in calls_in(fn)
        if position(c) > after
        and isinstance(c.func, ast.Attribute)
        and isinstance(c.func.value, ast.Name)
        and c.func.value.id == "self"
        and lookup(c.func.attr) is None
    ]


def worker_lock(resolve: Resolver) -> tuple[ast.FunctionDef | None, tuple[ast.Call, str] | None]:
    """Worker.compile_or_warm_up_model(), and the first lock after its capture_model() call."""
    warmup = first_def(resolve, GPU_WORKER, "compile_or_warm_up_model")
    if warmup is None:
        return None, None
    capture = next((c for c in calls_in(warmup) if call_name(c) == "capture_model"), None)
    if capture is None:
        return warmup, None
    locks = locks_after(warmup, position(capture), lambda n: first_def(resolve, GPU_WORKER, n))
    return warmup, (locks[0] if locks else None)


def rule_workspace_locked_after_capture(fn: ast.FunctionDef, resolve: Resolver) -> RuleVerdict:
    captures = capture_calls(fn)
    if not captures:
        return RuleVerdict(
            UNKNOWN,
            fn.lineno,
            f"{fn.name}() calls nothing named capture or _capture_*: the rule "
            "cannot see where graphs are captured, so it cannot tell whether "
            "the workspace is locked after them",
        )
    last = captures[-1]
    captured = f"{short(last.func)}() at line {last.lineno}"
    locks = locks_after(fn, position(last), resolve)
    if locks:
        call, text = locks[0]
        return RuleVerdict(
            PRESENT, call.lineno, f"{text}, after the capture by {captured}: a later workspace growth raises"
        )
    warmup, lock = worker_lock(resolve)
    if lock is not None:
        call, text = lock
        return RuleVerdict(
            PRESENT,
            call.lineno,
            f"Worker.compile_or_warm_up_model() locks the workspace after capture_model(): {text} of {GPU_WORKER}",
            file=GPU_WORKER,
        )
    unread = unread_self_calls(fn, position(last), resolve)
    if unread:
        names = ", ".join(f"self.{c.func.attr}() (line {c.lineno})" for c in unread)
        return RuleVerdict(
            UNKNOWN,
            unread[0].lineno,
            f"no lock after the capture by {captured}, but {fn.name}() then "
            f"calls {names}, defined in none of the files read: the rule "
            "cannot see whether it locks the workspace",
        )
    before = [c for c in calls_in(fn) if is_workspace_lock(c)]
    earlier = f" (the lock at line {before[0].lineno} runs before it)" if before else ""
    worker = (
        "or in Worker.compile_or_warm_up_model()"
        if warmup is not None
        else f"(and no Worker.compile_or_warm_up_model() in {GPU_WORKER} to read)"
    )
    return RuleVerdict(
        ABSENT,
        last.lineno,
        f"graphs captured by {captured}{earlier}; no lock_workspace() after it "
        f"in {fn.name}() {worker}: a later workspace growth frees the arena "
        "the graphs read",
    )


# -- #53508: block-table layout tensors keep their storage across a KV-cache wake ------------
#
# vLLM #53197: Model Runner V2's fused MTP draft graph (#46849) reads the block-table layout
# tensors (BlockTables.block_table_ptrs, block_table_strides, ...: block_table.py) by address.
# At a KV-cache wake, Worker.wake_up() called the runner's post_kv_cache_wake_up(), which
# rebuilt them (`self.block_table_ptrs = <new tensor>`): Python saw new tensors, the graph the
# old addresses -> illegal address on the first request after wake. The rebuild existed
# because the tensors were made inside the kv_cache memory-pool scope, where level-1 sleep
# discards their contents and keeps their virtual address. Two fixes keep the storage:
# #53197 refreshes the values in place (`copy_()`) at wake; #53508 (merged) scopes the
# kv_cache pool to the backing allocation -- the runner's initialize_kv_cache() takes a
# `kv_cache_allocation_context` -- and stops running the hook at wake. This rule accepts both.

LAYOUT_HOOK = "post_kv_cache_wake_up"
IN_PLACE_OPS = ("copy_", "fill_", "zero_")
TENSOR_FACTORIES = {
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "stack",
    "cat",
    "clone",
}
# Methods that read a tensor or container without replacing anything: not worth following.
READ_ONLY = {
    "data_ptr",
    "stride",
    "size",
    "numel",
    "dim",
    "item",
    "tolist",
    "element_size",
    "view",
    "reshape",
    "contiguous",
    "get",
    "items",
    "keys",
    "values",
}
FOLLOW_DEPTH = 2  # hook -> BlockTables method -> its helper


@dataclass(frozen=True)
class WakeEffect:
    kind: Literal["rebuild", "in_place", "unread"]
    node: ast.AST
    text: str
    file: str  # the file the node is in (a BlockTables method: block_table.py)


def makes_tensor(value: ast.AST, resolve: Resolver) -> bool:
    """Is `value` a new tensor or tensor holder: a torch factory, a call named *tensor*, a class
    constructed anew (``BlockTables(...)``), or a method whose return value is a factory's
    (``self._make_ptr_tensor(...)``)?"""
    if not isinstance(value, ast.Call) or (name := call_name(value)) is None:
        return False
    if name in TENSOR_FACTORIES or "tensor" in name.lower() or name[:1].isupper():
        return True
    helper = resolve(name) if self_rooted(value.func) else None
    return helper is not None and any(
        isinstance(n, ast.Return)
        and n.value is not None
        and isinstance(n.value, ast.Call)
        and (call_name(n.value) in TENSOR_FACTORIES)
        for n in ast.walk(helper)
    )


def is_layout(target: ast.AST, resolve: Resolver, in_fn: ast.AST) -> bool:
    """Block-table state: an attribute written inside block_table.py, or one named *block*."""
    return resolve.file_of(in_fn) == V2_BLOCK_TABLE or "block" in short(target, 200).lower()


def wake_effects(fn: ast.AST, resolve: Resolver, depth: int = FOLLOW_DEPTH) -> list[WakeEffect]:
    """What fn does to the block-table layout, following the self-rooted calls it makes."""
    effects: list[WakeEffect] = []
    file = resolve.file_of(fn)
    for node in walk_in_order(fn):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and self_rooted(target)
                    and makes_tensor(node.value, resolve)
                    and is_layout(target, resolve, fn)
                ):
                    effects.append(WakeEffect("rebuild", node, f"{short(target, 50)} = {short(node.value, 50)}", file))
                elif isinstance(target, ast.Subscript) and self_rooted(target) and is_layout(target, resolve, fn):
                    effects.append(WakeEffect("in_place", node, short(node, 70), file))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and self_rooted(node.func.value):
            name = node.func.attr
            if name in IN_PLACE_OPS:
                if is_layout(node.func.value, resolve, fn):
                    effects.append(WakeEffect("in_place", node, f"{short(node.func.value, 50)}.{name}(...)", file))
            elif name not in READ_ONLY and name not in TENSOR_FACTORIES:
                helper = resolve(name)
                if helper is None:
                    effects.append(WakeEffect("unread", node, f"{short(node.func)}()", file))
                elif helper is not fn and depth > 0:
                    effects += wake_effects(helper, resolve, depth - 1)
    return effects


def hook_runs_at_wake(resolve: Resolver) -> tuple[bool | None, ast.AST | None]:
    """Does Worker.wake_up() (or a worker method it calls) call post_kv_cache_wake_up()?
    None: there is no Worker.wake_up() to read."""
    wake = first_def(resolve, GPU_WORKER, "wake_up")
    if wake is None:
        return None, None
    bodies = [wake] + [
        h
        for c in calls_in(wake)
        if isinstance(c.func, ast.Attribute)
        and isinstance(c.func.value, ast.Name)
        and c.func.value.id == "self"
        and (h := first_def(resolve, GPU_WORKER, c.func.attr)) is not None
        and h is not wake
    ]
    for body in bodies:
        hook = next((c for c in calls_in(body) if call_name(c) == LAYOUT_HOOK), None)
        if hook is not None:
            return True, hook
    return False, None


def allocation_context_param(fn: ast.FunctionDef) -> str | None:
    """The `*allocation_context*` parameter fn takes and uses (#53508's pool scope)."""
    args = fn.args
    for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):
        if "allocation_context" in arg.arg and any(
            isinstance(n, ast.Name) and n.id == arg.arg for stmt in fn.body for n in ast.walk(stmt)
        ):
            return arg.arg
    return None


def pool_around_init(resolve: Resolver) -> ast.With | None:
    """The `with <...pool...>:` around initialize_kv_cache() in Worker.initialize_from_config()."""
    init = first_def(resolve, GPU_WORKER, "initialize_from_config")
    if init is None:
        return None
    aliases = alias_map(init)
    for node in walk_in_order(init):
        if (
            isinstance(node, (ast.With, ast.AsyncWith))
            and any(call_name(c) == "initialize_kv_cache" for s in node.body for c in calls_in(s))
            and any(
                "pool" in i.lower()
                for item in node.items
                for i in identifiers(item.context_expr)
                | {a for n in identifiers(item.context_expr) for a in aliases.get(n, ())}
            )
        ):
            return node
    return None


def judge_wake_effects(
    hook: ast.FunctionDef, call: ast.AST | None, effects: list[WakeEffect], resolve: Resolver
) -> RuleVerdict:
    """The verdict when the wake-up hook touches the layout: a rebuild outweighs code the rule
    cannot read, which outweighs an in-place refresh. `call`: where the worker runs the hook
    (None: no Worker.wake_up() to read)."""
    effect = next(e for kind in ("rebuild", "unread", "in_place") for e in effects if e.kind == kind)
    file = None if effect.file == resolve.home else effect.file
    at = f"{effect.file}:{effect.node.lineno}" if file else f"line {effect.node.lineno}"
    if call is None:
        return RuleVerdict(
            UNKNOWN,
            hook.lineno,
            f"{LAYOUT_HOOK}() (line {hook.lineno}) touches the block-table layout "
            f"({effect.text}, {at}), but there is no Worker.wake_up() in "
            f"{GPU_WORKER} to read: the rule cannot tell whether it runs at a "
            "KV-cache wake",
        )
    called = f"Worker.wake_up() calls {LAYOUT_HOOK}() ({GPU_WORKER}:{call.lineno})"
    if effect.kind == "rebuild":
        return RuleVerdict(
            ABSENT,
            effect.node.lineno,
            f"{called}, which rebinds {effect.text} ({at}): graphs captured before sleep keep reading the old tensor",
            file=file,
        )
    if effect.kind == "unread":
        return RuleVerdict(
            UNKNOWN,
            effect.node.lineno,
            f"{called}, which calls {effect.text} ({at}), defined in none of the "
            "files read: the rule cannot tell whether it rebuilds the layout "
            "tensors or refreshes them in place",
            file=file,
        )
    return RuleVerdict(
        PRESENT,
        effect.node.lineno,
        f"{called}, which refreshes the layout in place ({effect.text}, {at}); nothing is rebound",
        file=file,
    )


def judge_untouched_layout(fn: ast.FunctionDef, idle: str, resolve: Resolver) -> RuleVerdict:
    """The verdict when nothing touches the layout at wake (`idle` says why): it survives
    level-1 sleep only if it was made outside the kv_cache pool."""
    param = allocation_context_param(fn)
    if param is not None:
        return RuleVerdict(
            PRESENT,
            fn.lineno,
            f"{fn.name}() takes and uses {param} (the kv_cache pool wraps only "
            f"the backing allocation) and {idle}: the layout tensors keep their "
            "storage and values across sleep",
        )
    pool = pool_around_init(resolve)
    if pool is not None:
        return RuleVerdict(
            ABSENT,
            pool.lineno,
            f"Worker.initialize_from_config() enters the kv_cache pool around "
            f"initialize_kv_cache() ({GPU_WORKER}:{pool.lineno}) and {idle}: "
            "level-1 sleep loses the layout tensors' values at the same address",
            file=GPU_WORKER,
        )
    return RuleVerdict(
        UNKNOWN,
        fn.lineno,
        f"{idle}, and {fn.name}() takes no allocation context while no "
        f"Worker.initialize_from_config() in {GPU_WORKER} visibly enters the "
        "kv_cache pool around it: the rule cannot see where the pool scope "
        "ends, so it cannot tell whether the layout tensors survive sleep",
    )


def rule_layout_kept_at_wake(fn: ast.FunctionDef, resolve: Resolver) -> RuleVerdict:
    hook = resolve.siblings(LAYOUT_HOOK)
    runs, call = hook_runs_at_wake(resolve)
    effects = wake_effects(hook, resolve) if hook is not None else []
    if effects and runs is not False:
        return judge_wake_effects(hook, call, effects, resolve)
    if hook is None:
        idle = f"the runner defines no {LAYOUT_HOOK}()"
    elif runs is False:
        idle = f"Worker.wake_up() does not call {LAYOUT_HOOK}()"
    else:
        idle = f"{LAYOUT_HOOK}() leaves the block-table layout alone"
    return judge_untouched_layout(fn, idle, resolve)


# --------------------------------------------------------------------------- the table

GEMMA4_MTP = "vllm/model_executor/models/gemma4_mtp.py"
ONLINE_NVFP4 = "vllm/model_executor/layers/quantization/online/nvfp4.py"

FIXES: tuple[Fix, ...] = (
    Fix(
        fix_id="43909",
        title="Gemma 4 MTP: gathered lm_head cached on the module (TP>1)",
        file=GEMMA4_MTP,
        function="_get_full_lm_head_weight",
        rule=rule_cached_gather,
        url="https://github.com/vllm-project/vllm/pull/43909",
    ),
    Fix(
        fix_id="50074",
        title="Online NVFP4 MoE: kernel built once, reused across reloads",
        file=ONLINE_NVFP4,
        function="_setup_kernel",
        rule=rule_kernel_built_once,
        url="https://github.com/vllm-project/vllm/pull/50074",
    ),
    Fix(
        fix_id="57954",
        title="Online NVFP4 MoE: reused config alphas refreshed before expert PWAL",
        file=ONLINE_NVFP4,
        function="_setup_kernel",
        rule=rule_alphas_refreshed,
        url="https://github.com/vllm-project/vllm/pull/57954",
    ),
    Fix(
        fix_id="55341",
        title="Model Runner V2: workspace locked after CUDA-graph capture",
        file=V2_RUNNER,
        function="capture_model",
        rule=rule_workspace_locked_after_capture,
        url="https://github.com/vllm-project/vllm/pull/55341",
        also=(GPU_WORKER,),
    ),
    Fix(
        fix_id="53508",
        title="Model Runner V2: block-table layout kept in place across a KV-cache wake",
        file=V2_RUNNER,
        function="initialize_kv_cache",
        rule=rule_layout_kept_at_wake,
        url="https://github.com/vllm-project/vllm/pull/53508",
        also=(V2_BLOCK_TABLE, GPU_WORKER),
    ),
)


def normalize_fix_id(fix_id: str) -> str:
    return str(fix_id).strip().lstrip("#")


def find_fix(fix_id: str) -> Fix:
    wanted = normalize_fix_id(fix_id)
    for fix in FIXES:
        if fix.fix_id == wanted:
            return fix
    known = ", ".join(f.fix_id for f in FIXES)
    raise AuditError(f"Unknown fix id {fix_id!r}; use one of: {known}.")


# --------------------------------------------------------------------------- locating code


@dataclass
class Site:
    """One definition of the audited function, or where one is that does not parse here."""

    node: ast.FunctionDef | None
    resolve: Callable[[str], ast.FunctionDef | None]
    line: int  # 1-based line of the `def`
    error: str = ""  # why node is None


CONFLICT_MARKER = re.compile(r"^(<{7}|={7}|>{7}|\|{7})(\s|$)")


def text_function_spans(text: str, name: str) -> list[tuple[int, int]]:
    """(start, end) 0-based line spans of every `def name(` found by indentation."""
    lines = text.splitlines()
    spans = []
    header = re.compile(rf"^(\s*)(?:async\s+)?def\s+{re.escape(name)}\s*\(")
    for i, line in enumerate(lines):
        m = header.match(line)
        if not m:
            continue
        indent = len(m.group(1))
        end = i + 1
        for j in range(i + 1, len(lines)):
            stripped = lines[j].strip()
            if not stripped:
                continue
            this = len(lines[j]) - len(lines[j].lstrip())
            # A line at or left of the `def` ends it, unless it closes the signature or is
            # a leftover merge-conflict marker (a common reason a file stops parsing).
            if this <= indent and not stripped.startswith((")", "]", "}")) and not CONFLICT_MARKER.match(lines[j]):
                break
            end = j + 1
        spans.append((i, end))
    return spans


def parse_span(text: str, name: str) -> list[Site]:
    """Parse each definition on its own, keeping the real file's line numbers."""
    lines = text.splitlines()
    out = []
    for start, end in text_function_spans(text, name):
        try:
            tree = ast.parse(textwrap.dedent("\n".join(lines[start:end])))
        except UNPARSABLE as exc:
            out.append(Site(None, lambda _: None, start + 1, unparsable_text(exc, lines, start, end)))
            continue
        ast.increment_lineno(tree, start)
        fn = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
        out.append(Site(fn, lambda _: None, start + 1, "" if fn else "no function in its span"))
    return out


def unparsable_text(exc: Exception, lines: list[str], start: int, end: int) -> str:
    """Why a definition spanning lines[start:end] does not parse, with a real line number."""
    marker = next((k for k in range(start, end) if CONFLICT_MARKER.match(lines[k])), None)
    if marker is not None:
        return f"merge-conflict marker at line {marker + 1}"
    line = getattr(exc, "lineno", None)
    where = f" at line {start + line}" if isinstance(line, int) else ""
    return f"{type(exc).__name__}{where}: {getattr(exc, 'msg', None) or exc}"


def locate_sites(text: str, name: str) -> list[Site]:
    try:
        tree = ast.parse(text)
    except UNPARSABLE:
        # The file uses syntax this interpreter lacks (e.g. a 3.12-only statement
        # somewhere); the function itself usually still parses on its own.
        def resolve_text(method: str) -> ast.FunctionDef | None:
            return next((s.node for s in parse_span(text, method) if s.node is not None), None)

        return [dataclasses.replace(s, resolve=resolve_text) for s in parse_span(text, name)]
    sites = []
    for owner in ast.walk(tree):
        body = getattr(owner, "body", None)
        if not isinstance(body, list):
            continue
        methods = {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if name in methods:
            sites.append(Site(methods[name], methods.get, methods[name].lineno))
    return sites


class Resolver:
    """The functions a rule may follow from the one it judges.

    Calling it with a name gives the judged function's sibling method of that name, else the
    first function of that name in the fix's other files (``Fix.also``); ``defined`` looks in
    one named file only. ``file_of`` says which file a returned node came from, for evidence.
    """

    def __init__(self, siblings: Callable[[str], ast.FunctionDef | None], home: str, others: dict[str, str | None]):
        self.siblings = siblings
        self.home = home
        self.others = others
        self._found: dict[tuple[str, str], list[ast.FunctionDef]] = {}
        self._files: dict[int, str] = {}  # id(node) -> file, for nodes from `others`

    def __call__(self, name: str) -> ast.FunctionDef | None:
        node = self.siblings(name)
        if node is not None:
            return node
        return next((found[0] for file in self.others if (found := self.defined(file, name))), None)

    def defined(self, file: str, name: str) -> list[ast.FunctionDef]:
        """Every definition of `name` that parses in `file` ([] when the file is absent)."""
        key = (file, name)
        if key not in self._found:
            text = self.others.get(file)
            nodes = [s.node for s in locate_sites(text, name) if s.node is not None] if text is not None else []
            self._files.update((id(n), file) for n in nodes)
            self._found[key] = nodes
        return self._found[key]

    def file_of(self, node: ast.AST) -> str:
        return self._files.get(id(node), self.home)


def judge(fix: Fix, text: str | None, others: dict[str, str | None] | None = None) -> FixCheck:
    """The fix's state in one file's text (None: the file does not exist); `others` holds the
    texts of the fix's other files (``Fix.also``), None for those that do not exist.

    A definition whose own body does not parse cannot be judged: AuditError names it, rather
    than a guess from text (a leftover merge-conflict marker is the usual cause)."""

    def check(state: State, line: int | None, evidence: str, file: str | None = None) -> FixCheck:
        return FixCheck(fix.fix_id, fix.title, state, file or fix.file, line, evidence)

    if text is None:
        return check(NOT_APPLICABLE, None, f"{fix.file} does not exist in this version")
    sites = locate_sites(text, fix.function)
    if not sites:
        return check(
            ABSENT,
            None,
            f"{fix.file} exists but defines no {fix.function}(); the rule cannot find where the fix would live",
        )
    broken = next((s for s in sites if s.node is None), None)
    if broken is not None:
        raise AuditError(
            f"{fix.file}:{broken.line}: {fix.function}() does not parse "
            f"({broken.error}), so fix #{fix.fix_id} cannot be judged; repair the "
            "file or audit another copy."
        )
    texts = {file: (others or {}).get(file) for file in fix.also}
    findings = [fix.rule(site.node, Resolver(site.resolve, fix.file, texts)) for site in sites]
    # Several definitions (e.g. one per class): the fix is carried if any carries it.
    best = next((f for f in findings if f.state == PRESENT), findings[0])
    return check(best.state, best.line, best.evidence, best.file)


def judge_all(read: Callable[[str], str | None]) -> list[FixCheck]:
    return [judge(fix, read(fix.file), {file: read(file) for file in fix.also}) for fix in FIXES]
