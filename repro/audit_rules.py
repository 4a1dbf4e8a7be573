"""The upstream fixes vllm-audit knows, and the rules that find each one in source text.

Each fix is judged by a rule that looks inside the body of one named function (parsed with
``ast``, line numbers those of the real file), with a resolver for sibling methods so a fix
factored into a helper still counts. Knowledge of fixes lives in ``FIXES`` only: adding a fix
is adding one ``Fix`` entry with its rule. Where the text comes from (a directory, a wheel, an
sdist, the installed package) is repro.audit's concern, not this module's.
"""
from __future__ import annotations

import ast
import dataclasses
import re
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

State = Literal["present", "absent", "not-applicable"]

PRESENT: State = "present"
ABSENT: State = "absent"
NOT_APPLICABLE: State = "not-applicable"

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
    file: str                 # path inside the package tree, e.g. vllm/model_executor/...
    line: int | None          # 1-based line of the evidence in that file
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


# A rule sees the function's AST (line numbers are those of the real file) and a resolver
# for sibling methods of the same class, so a fix factored into a helper still counts.
AstRule = Callable[[ast.FunctionDef, Callable[[str], "ast.FunctionDef | None"]], RuleVerdict]


@dataclass(frozen=True)
class Fix:
    fix_id: str               # upstream PR number, without '#'
    title: str
    file: str                 # path inside the package tree ("vllm/...")
    function: str             # the function/method whose body carries the fix
    rule: AstRule
    url: str = ""


def self_attr(node: ast.AST) -> str | None:
    """'x' for ``self.x`` or ``getattr(self, "x"[, default])``, else None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id == "self":
        return node.attr
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id == "getattr" and len(node.args) >= 2 \
            and isinstance(node.args[0], ast.Name) and node.args[0].id == "self" \
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
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
            attr = self_attr(node)   # getattr(self, "x", None)
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
            continue   # `self.x = None` is a reset, not a cache fill
        ids = identifiers(value)
        if ids & tainted or any(w in i.lower() for i in ids for w in WEIGHTY):
            writes.append((stmt, attr, value))
    for stmt, attr, value in writes:
        if attr in reads:
            return RuleVerdict(PRESENT, stmt.lineno,
                           f"self.{attr} = {short(value)} at line {stmt.lineno}, "
                           f"read back at line {reads[attr]}")
    if writes:
        stmt, attr, _ = writes[0]
        return RuleVerdict(ABSENT, stmt.lineno,
                       f"self.{attr} is written at line {stmt.lineno} but never read back "
                       f"in {fn.name}, so it is not used as a cache")
    gather = first_gather(fn)
    if gather is not None:
        return RuleVerdict(ABSENT, gather.lineno,
                       f"{short(gather.func)}(...) at line {gather.lineno} goes into a local "
                       f"only; no self.<attr> cache in {fn.name}")
    return RuleVerdict(ABSENT, fn.lineno,
                   f"{fn.name} stores no gathered weight on self (no all-gather found either)")


# -- #50074: the MoE kernel is built only once -------------------------------------------

def block_fields(stmt: ast.stmt) -> list[list[ast.stmt]]:
    blocks = [getattr(stmt, name) for name in ("body", "orelse", "finalbody")
              if isinstance(getattr(stmt, name, None), list)]
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
        held = [(s.test, False) for s in body[:i]
                if isinstance(s, ast.If) and not s.orelse and always_exits(s.body)]
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
        return not holds          # `if not self.k` / `else` of `if self.k`
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
    return [(stmt, attr, value) for stmt, target, value in assignments(fn)
            if (attr := self_attr(target)) is not None and "kernel" in attr.lower()
            and isinstance(value, ast.Call)]


def rule_kernel_built_once(fn: ast.FunctionDef, resolve: Callable[[str], Any]) -> RuleVerdict:
    builds = kernel_builds(fn)
    if not builds:
        return RuleVerdict(ABSENT, fn.lineno,
                       f"no self.<kernel> = <call> construction found in {fn.name}; "
                       "cannot see a kernel being built")
    guarded = []
    for stmt, attr, value in builds:
        guard = next((test for test, holds in conditions_for(fn.body, stmt)
                      if tests_unset(test, holds, attr)), None)
        if guard is None:
            return RuleVerdict(ABSENT, stmt.lineno,
                           f"self.{attr} = {short(value.func)}(...) at line {stmt.lineno} "
                           "runs on every call (no `is None` guard)")
        guarded.append((stmt, attr, value, guard))
    stmt, attr, value, guard = guarded[0]
    return RuleVerdict(PRESENT, stmt.lineno,
                   f"self.{attr} = {short(value.func)}(...) at line {stmt.lineno} guarded by "
                   f"`{short(guard)}` (line {guard.lineno})")


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
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "copy_":
            receiver = node.func.value
            if refers_to(receiver, alpha, aliases) and node.args:
                found.append((node, f"{short(receiver, 50)}.copy_({short(node.args[0], 40)})"))
            elif node.args and refers_to(node.args[0], alpha, aliases):
                found.append((node, short(node, 90)))
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Subscript) and refers_to(t.value, alpha, aliases)
                for t in node.targets):
            found.append((node, short(node, 90)))
    return found


def self_method_calls(fn: ast.AST) -> list[tuple[ast.Call, str]]:
    return [(n, n.func.attr) for n in walk_in_order(fn)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]


def alpha_refreshes(fn: ast.FunctionDef, resolve: Callable[[str], Any],
                    alpha: str) -> list[tuple[tuple[int, int], int, str]]:
    """(position in fn, line, description) of each write into `alpha`, including writes
    made one call deep in a sibling method, positioned at the call site."""
    hits = [(position(n), n.lineno, text) for n, text in alpha_writes(fn, alpha)]
    for call, name in self_method_calls(fn):
        helper = resolve(name)
        if helper is None or helper is fn or name == PWAL:
            continue
        for n, text in alpha_writes(helper, alpha):
            hits.append((position(call), n.lineno, f"{text} in self.{name}() called at line "
                                                   f"{call.lineno}"))
    return sorted(hits)


def pwal_calls(fn: ast.AST) -> list[ast.Call]:
    calls = [n for n in walk_in_order(fn) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == PWAL]
    # Prefer the expert-level call the fix is about; fall back to any PWAL call.
    experts = [c for c in calls if "fused_experts" in identifiers(c.func)]
    return experts or calls


def rule_alphas_refreshed(fn: ast.FunctionDef, resolve: Callable[[str], Any]) -> RuleVerdict:
    pwals = pwal_calls(fn)
    if not pwals:
        return RuleVerdict(ABSENT, fn.lineno,
                       f"no {PWAL}(...) call in {fn.name}; cannot place an alpha refresh "
                       "before it")
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
        return RuleVerdict(ABSENT, line, f"{text} at line {line} comes after {where}: "
                                     "expert post-processing still sees the old alphas")
    if before:
        return RuleVerdict(ABSENT, before[0][1],
                       f"only {before[0][2]} (line {before[0][1]}) before {where}; "
                       f"{', '.join(missing)} not refreshed")
    return RuleVerdict(ABSENT, last.lineno,
                   f"no in-place refresh of {' / '.join(ALPHAS)} before {where}")


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
    line: int                 # 1-based line of the `def`
    error: str = ""           # why node is None


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
            if this <= indent and not stripped.startswith((")", "]", "}")) \
                    and not CONFLICT_MARKER.match(lines[j]):
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
        fn = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
                  None)
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


def judge(fix: Fix, text: str | None) -> FixCheck:
    """The fix's state in one file's text (None: the file does not exist).

    A definition whose own body does not parse cannot be judged: AuditError names it, rather
    than a guess from text (a leftover merge-conflict marker is the usual cause)."""
    def check(state: State, line: int | None, evidence: str) -> FixCheck:
        return FixCheck(fix.fix_id, fix.title, state, fix.file, line, evidence)

    if text is None:
        return check(NOT_APPLICABLE, None, f"{fix.file} does not exist in this version")
    sites = locate_sites(text, fix.function)
    if not sites:
        return check(ABSENT, None,
                     f"{fix.file} exists but defines no {fix.function}(); the rule cannot "
                     "find where the fix would live")
    broken = next((s for s in sites if s.node is None), None)
    if broken is not None:
        raise AuditError(f"{fix.file}:{broken.line}: {fix.function}() does not parse "
                         f"({broken.error}), so fix #{fix.fix_id} cannot be judged; repair the "
                         "file or audit another copy.")
    findings = [fix.rule(site.node, site.resolve) for site in sites]
    # Several definitions (e.g. one per class): the fix is carried if any carries it.
    best = next((f for f in findings if f.state == PRESENT), findings[0])
    return check(best.state, best.line, best.evidence)


def judge_all(read: Callable[[str], str | None]) -> list[FixCheck]:
    return [judge(fix, read(fix.file)) for fix in FIXES]
