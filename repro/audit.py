"""Static audit: which upstream CUDA-graph lifetime fixes does a vLLM source carry?

vLLM is never imported: importing it initialises CUDA, logging and plugins, and the audit
must also work on wheels for other Python versions and on machines without a GPU. The
source is read as text -- from the installed package (located with
``importlib.util.find_spec``, which for a top-level name only consults the path finders and
executes nothing), from a directory, or member by member from a .whl/.zip/sdist archive --
and each known fix is judged by a rule that looks inside the body of one named function.

Knowledge of fixes lives in ``FIXES`` only; adding a fix is adding one ``Fix`` entry with
its rule.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import importlib.util
import re
import tarfile
import textwrap
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

State = Literal["present", "absent", "not-applicable"]
Kind = Literal["installed", "directory", "archive"]

PRESENT: State = "present"
ABSENT: State = "absent"
NOT_APPLICABLE: State = "not-applicable"

# A source file bigger than this is not a Python module we care about; the cap keeps a
# hostile or corrupt archive from making us inflate gigabytes into memory.
MAX_MEMBER_BYTES = 8 * 1024 * 1024

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


@dataclass
class AuditResult:
    source: str               # what was audited: a directory or an archive path
    kind: Kind
    version: str | None
    checks: list[FixCheck] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "kind": self.kind,
            "version": self.version,
            "checks": [c.to_dict() for c in self.checks],
        }

    def check(self, fix_id: str) -> FixCheck:
        wanted = normalize_fix_id(fix_id)
        for c in self.checks:
            if c.fix_id == wanted:
                return c
        raise KeyError(fix_id)


# --------------------------------------------------------------------------- rules

@dataclass(frozen=True)
class Finding:
    """What a rule concluded about one function body."""
    state: State
    line: int | None
    evidence: str


# A rule sees the function's AST (line numbers are those of the real file) and a resolver
# for sibling methods of the same class, so a fix factored into a helper still counts.
AstRule = Callable[[ast.FunctionDef, Callable[[str], "ast.FunctionDef | None"]], Finding]
# The text rule is the last resort, for a function whose own body does not parse here
# (syntax newer than this interpreter). It sees (line number, code without comment) pairs.
TextRule = Callable[[list[tuple[int, str]]], Finding]


@dataclass(frozen=True)
class Fix:
    fix_id: str               # upstream PR number, without '#'
    title: str
    file: str                 # path inside the package tree ("vllm/...")
    function: str             # the function/method whose body carries the fix
    ast_rule: AstRule
    text_rule: TextRule
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


def rule_cached_gather(fn: ast.FunctionDef, resolve: Callable[[str], Any]) -> Finding:
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
            return Finding(PRESENT, stmt.lineno,
                           f"self.{attr} = {short(value)} at line {stmt.lineno}, "
                           f"read back at line {reads[attr]}")
    if writes:
        stmt, attr, _ = writes[0]
        return Finding(ABSENT, stmt.lineno,
                       f"self.{attr} is written at line {stmt.lineno} but never read back "
                       f"in {fn.name}, so it is not used as a cache")
    gather = first_gather(fn)
    if gather is not None:
        return Finding(ABSENT, gather.lineno,
                       f"{short(gather.func)}(...) at line {gather.lineno} goes into a local "
                       f"only; no self.<attr> cache in {fn.name}")
    return Finding(ABSENT, fn.lineno,
                   f"{fn.name} stores no gathered weight on self (no all-gather found either)")


SELF_WRITE_TEXT = re.compile(r"^\s*self\.(\w+)\s*(?::[^=]+)?=(?!=)\s*(.*)$")


def text_cached_gather(lines: list[tuple[int, str]]) -> Finding:
    for lineno, code in lines:
        m = SELF_WRITE_TEXT.match(code)
        if not m or m.group(2).strip().startswith("None"):
            continue
        attr = m.group(1)
        read = re.compile(rf"\bself\.{attr}\b(?!\s*(?::[^=]+)?=(?!=))")
        for other, text in lines:
            if other != lineno and read.search(text):
                return Finding(PRESENT, lineno,
                               f"(text match) self.{attr} = {m.group(2).strip()[:60]} at line "
                               f"{lineno}, read back at line {other}")
    for lineno, code in lines:
        if "gather" in code:
            return Finding(ABSENT, lineno,
                           f"(text match) gather at line {lineno} goes into a local only")
    return Finding(ABSENT, lines[0][0] if lines else None,
                   "(text match) no cached self.<attr> assignment found")


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


def rule_kernel_built_once(fn: ast.FunctionDef, resolve: Callable[[str], Any]) -> Finding:
    builds = kernel_builds(fn)
    if not builds:
        return Finding(ABSENT, fn.lineno,
                       f"no self.<kernel> = <call> construction found in {fn.name}; "
                       "cannot see a kernel being built")
    guarded = []
    for stmt, attr, value in builds:
        guard = next((test for test, holds in conditions_for(fn.body, stmt)
                      if tests_unset(test, holds, attr)), None)
        if guard is None:
            return Finding(ABSENT, stmt.lineno,
                           f"self.{attr} = {short(value.func)}(...) at line {stmt.lineno} "
                           "runs on every call (no `is None` guard)")
        guarded.append((stmt, attr, value, guard))
    stmt, attr, value, guard = guarded[0]
    return Finding(PRESENT, stmt.lineno,
                   f"self.{attr} = {short(value.func)}(...) at line {stmt.lineno} guarded by "
                   f"`{short(guard)}` (line {guard.lineno})")


KERNEL_BUILD_TEXT = re.compile(r"^(\s*)self\.(\w*kernel\w*)\s*(?::[^=]+)?=(?!=)\s*[\w.]+\s*\(")


def enclosing_headers(lines: list[tuple[int, str]], index: int) -> list[tuple[int, str]]:
    """Block header lines (if/elif/else/...) enclosing lines[index], innermost first."""
    indent = len(lines[index][1]) - len(lines[index][1].lstrip())
    headers = []
    for lineno, code in reversed(lines[:index]):
        if not code.strip():
            continue
        this = len(code) - len(code.lstrip())
        if this < indent and code.rstrip().endswith(":"):
            headers.append((lineno, code.strip()))
            indent = this
    return headers


def text_kernel_built_once(lines: list[tuple[int, str]]) -> Finding:
    for index, (lineno, code) in enumerate(lines):
        m = KERNEL_BUILD_TEXT.match(code)
        if not m:
            continue
        attr = m.group(2)
        unset = re.compile(rf"^(el)?if\b.*(\bnot\s+self\.{attr}\b|\bself\.{attr}\s+is\s+None\b)")
        for header_line, header in enclosing_headers(lines, index):
            if unset.search(header):
                return Finding(PRESENT, lineno,
                               f"(text match) self.{attr} built at line {lineno} under "
                               f"`{header}` (line {header_line})")
        return Finding(ABSENT, lineno,
                       f"(text match) self.{attr} built at line {lineno} without an `is None` "
                       "guard")
    return Finding(ABSENT, lines[0][0] if lines else None,
                   "(text match) no kernel construction found")


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


def rule_alphas_refreshed(fn: ast.FunctionDef, resolve: Callable[[str], Any]) -> Finding:
    pwals = pwal_calls(fn)
    if not pwals:
        return Finding(ABSENT, fn.lineno,
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
        return Finding(PRESENT, before[0][1], f"{described} before {where}")
    missing = [alpha for alpha, hit in late if hit is None]
    after = [(alpha, hit) for alpha, hit in late if hit is not None]
    if after:
        alpha, (_, line, text) = after[0]
        return Finding(ABSENT, line, f"{text} at line {line} comes after {where}: "
                                     "expert post-processing still sees the old alphas")
    if before:
        return Finding(ABSENT, before[0][1],
                       f"only {before[0][2]} (line {before[0][1]}) before {where}; "
                       f"{', '.join(missing)} not refreshed")
    return Finding(ABSENT, last.lineno,
                   f"no in-place refresh of {' / '.join(ALPHAS)} before {where}")


def text_alphas_refreshed(lines: list[tuple[int, str]]) -> Finding:
    pwal = [n for n, code in lines if re.search(rf"\.{PWAL}\s*\(", code)]
    if not pwal:
        return Finding(ABSENT, lines[0][0] if lines else None,
                       f"(text match) no {PWAL}(...) call")
    copies = {a: [n for n, code in lines if a in code and ".copy_(" in code] for a in ALPHAS}
    if all(any(n < pwal[-1] for n in copies[a]) for a in ALPHAS):
        first = min(n for a in ALPHAS for n in copies[a] if n < pwal[-1])
        return Finding(PRESENT, first, f"(text match) {' and '.join(ALPHAS)} copied before "
                                       f"{PWAL} at line {pwal[-1]}")
    return Finding(ABSENT, pwal[-1],
                   f"(text match) no copy into both alphas before {PWAL} at line {pwal[-1]}")


# --------------------------------------------------------------------------- the table

GEMMA4_MTP = "vllm/model_executor/models/gemma4_mtp.py"
ONLINE_NVFP4 = "vllm/model_executor/layers/quantization/online/nvfp4.py"

FIXES: tuple[Fix, ...] = (
    Fix(
        fix_id="43909",
        title="Gemma 4 MTP: gathered lm_head cached on the module (TP>1)",
        file=GEMMA4_MTP,
        function="_get_full_lm_head_weight",
        ast_rule=rule_cached_gather,
        text_rule=text_cached_gather,
        url="https://github.com/vllm-project/vllm/pull/43909",
    ),
    Fix(
        fix_id="50074",
        title="Online NVFP4 MoE: kernel built once, reused across reloads",
        file=ONLINE_NVFP4,
        function="_setup_kernel",
        ast_rule=rule_kernel_built_once,
        text_rule=text_kernel_built_once,
        url="https://github.com/vllm-project/vllm/pull/50074",
    ),
    Fix(
        fix_id="57954",
        title="Online NVFP4 MoE: reused config alphas refreshed before expert PWAL",
        file=ONLINE_NVFP4,
        function="_setup_kernel",
        ast_rule=rule_alphas_refreshed,
        text_rule=text_alphas_refreshed,
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
    """One definition of the audited function: parsed, or as raw lines if it won't parse."""
    node: ast.FunctionDef | None
    resolve: Callable[[str], ast.FunctionDef | None]
    lines: list[tuple[int, str]]


def strip_comment(line: str) -> str:
    # Good enough for the text fallback: '#' inside strings is rare in these bodies.
    return line.split("#", 1)[0].rstrip() if "#" in line else line.rstrip()


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


def parse_span(text: str, name: str) -> list[tuple[ast.FunctionDef | None, list[tuple[int, str]]]]:
    """Parse each definition on its own, keeping the real file's line numbers."""
    lines = text.splitlines()
    out = []
    for start, end in text_function_spans(text, name):
        chunk = "\n".join(lines[start:end])
        numbered = [(start + k + 1, strip_comment(line))
                    for k, line in enumerate(lines[start:end])]
        try:
            tree = ast.parse(textwrap.dedent(chunk))
        except UNPARSABLE:
            out.append((None, numbered))
            continue
        ast.increment_lineno(tree, start)
        fn = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
                  None)
        out.append((fn, numbered))
    return out


def locate_sites(text: str, name: str) -> list[Site]:
    lines = text.splitlines()
    try:
        tree = ast.parse(text)
    except UNPARSABLE:
        # The file uses syntax this interpreter lacks (e.g. a 3.12-only statement
        # somewhere); the function itself usually still parses on its own.
        def resolve_text(method: str) -> ast.FunctionDef | None:
            return next((fn for fn, _ in parse_span(text, method) if fn is not None), None)
        return [Site(fn, resolve_text, numbered) for fn, numbered in parse_span(text, name)]
    sites = []
    for owner in ast.walk(tree):
        body = getattr(owner, "body", None)
        if not isinstance(body, list):
            continue
        methods = {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if name in methods:
            fn = methods[name]
            numbered = [(k, strip_comment(lines[k - 1]))
                        for k in range(fn.lineno, (fn.end_lineno or fn.lineno) + 1)]
            sites.append(Site(fn, methods.get, numbered))
    return sites


def judge(fix: Fix, text: str | None) -> FixCheck:
    def check(state: State, line: int | None, evidence: str) -> FixCheck:
        return FixCheck(fix.fix_id, fix.title, state, fix.file, line, evidence)

    if text is None:
        return check(NOT_APPLICABLE, None, f"{fix.file} does not exist in this version")
    sites = locate_sites(text, fix.function)
    if not sites:
        return check(ABSENT, None,
                     f"{fix.file} exists but defines no {fix.function}(); the rule cannot "
                     "find where the fix would live")
    findings = [site_finding(fix, site) for site in sites]
    # Several definitions (e.g. one per class): the fix is carried if any carries it.
    best = next((f for f in findings if f.state == PRESENT), findings[0])
    return check(best.state, best.line, best.evidence)


def site_finding(fix: Fix, site: Site) -> Finding:
    if site.node is not None:
        return fix.ast_rule(site.node, site.resolve)
    return fix.text_rule(site.lines)


def judge_all(read: Callable[[str], str | None]) -> list[FixCheck]:
    return [judge(fix, read(fix.file)) for fix in FIXES]


# --------------------------------------------------------------------------- versions

METADATA_VERSION = re.compile(r"^Version:\s*(\S+)\s*$", re.MULTILINE)
ARCHIVE_VERSION = re.compile(r"^vllm-(\d[^-]*?)(?:-|\.tar\.gz$|\.tgz$|\.tar$|\.zip$|\.whl$)",
                             re.IGNORECASE)


def version_from_metadata(text: str | None) -> str | None:
    if not text:
        return None
    headers = text.split("\n\n", 1)[0]   # the body may quote other Version: lines
    if not re.search(r"^Name:\s*vllm\s*$", headers, re.MULTILINE | re.IGNORECASE):
        return None
    m = METADATA_VERSION.search(headers)
    return m.group(1) if m else None


def version_from_module(text: str | None) -> str | None:
    """`__version__ = version = '0.33.0'` at module level of _version.py / version.py.

    Only top-level literals count: vllm/version.py assigns a "dev" fallback inside an
    `except` block, which is not the version."""
    if not text:
        return None
    try:
        tree = ast.parse(text)
    except UNPARSABLE:
        m = re.search(r"^__version__\s*=\s*(?:\w+\s*=\s*)*['\"]([^'\"]+)['\"]", text, re.M)
        return m.group(1) if m else None
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) \
                and isinstance(stmt.value.value, str) \
                and any(isinstance(t, ast.Name) and t.id in ("__version__", "version")
                        for t in stmt.targets):
            return stmt.value.value
    return None


def version_from_archive_name(path: Path) -> str | None:
    m = ARCHIVE_VERSION.match(path.name)
    return m.group(1) if m else None


def first_version(candidates: Iterable[Callable[[], str | None]]) -> str | None:
    for candidate in candidates:
        found = candidate()
        if found:
            return found
    return None


# --------------------------------------------------------------------------- sources

def read_text_file(path: Path) -> str | None:
    try:
        if not path.is_file() or path.stat().st_size > MAX_MEMBER_BYTES:
            return None
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return None


def package_dir_in(path: Path) -> Path | None:
    """The vllm/ package for a repo root / site-packages (DIR/vllm) or the package itself."""
    def looks_like_package(p: Path) -> bool:
        return p.is_dir() and ((p / "__init__.py").is_file() or (p / "model_executor").is_dir())

    if looks_like_package(path / "vllm"):
        return path / "vllm"
    if path.name == "vllm" and looks_like_package(path):
        return path
    return None


def directory_version(package: Path) -> str | None:
    root = package.parent

    def dist_info() -> str | None:
        for meta in sorted(root.glob("vllm-*.dist-info/METADATA")):
            found = version_from_metadata(read_text_file(meta))
            if found:
                return found
        return None

    return first_version([
        dist_info,
        lambda: version_from_metadata(read_text_file(root / "PKG-INFO")),
        lambda: version_from_module(read_text_file(package / "_version.py")),
        lambda: version_from_module(read_text_file(package / "version.py")),
    ])


def audit_package_dir(package: Path, source: str, kind: Kind,
                      version: str | None = None) -> AuditResult:
    def read(rel: str) -> str | None:
        # Fix paths are "vllm/..."; the package folder may be named otherwise (a vendored
        # copy), so resolve the part after the first component under it.
        return read_text_file(package / rel.split("/", 1)[1])

    return AuditResult(source=source, kind=kind,
                       version=version or directory_version(package),
                       checks=judge_all(read))


def audit_directory(path: str | Path) -> AuditResult:
    p = Path(path).expanduser()
    if not p.exists():
        raise AuditError(f"{p} does not exist; pass --path a vLLM checkout or its vllm/ "
                         "package folder.")
    if not p.is_dir():
        raise AuditError(f"{p} is not a directory; use --wheel for an archive or pass --path a "
                         "vLLM checkout or its vllm/ package folder.")
    package = package_dir_in(p)
    if package is None:
        raise AuditError(f"No vllm package found in {p} (looked for {p / 'vllm'} and for {p} "
                         "itself being vllm/); pass --path a vLLM checkout or its vllm/ folder.")
    return audit_package_dir(package, str(p), "directory")


def installed_package_dir() -> Path:
    # find_spec on a top-level name asks the path finders only; no vllm code runs.
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        raise AuditError("vllm is not installed in this Python environment "
                         "(importlib.util.find_spec('vllm') found nothing); install it, or "
                         "audit a checkout with --path DIR or an archive with --wheel FILE.")
    if spec.origin and spec.origin not in ("namespace", "built-in", "frozen"):
        return Path(spec.origin).parent
    locations = list(spec.submodule_search_locations or [])
    if not locations:
        raise AuditError("vllm is importable but has no file location (origin "
                         f"{spec.origin!r}); audit its source with --path DIR instead.")
    return Path(locations[0])


def installed_version(package: Path) -> str | None:
    # Ask only the distributions installed next to the package we audit, so a second
    # vllm elsewhere on sys.path cannot lend its version.
    for dist in importlib.metadata.distributions(path=[str(package.parent)]):
        if (dist.metadata["Name"] or "").lower() == "vllm":
            return dist.version
    return None


def audit_installed() -> AuditResult:
    package = installed_package_dir()
    return audit_package_dir(package, str(package), "installed", installed_version(package))


# -- archives: read member by member, never extract ------------------------------------

VERSION_MEMBERS = ("vllm/_version.py", "vllm/version.py")


def wanted_members() -> tuple[str, ...]:
    return tuple(sorted({f.file for f in FIXES} | set(VERSION_MEMBERS)))


def split_member(name: str, wanted: tuple[str, ...]) -> tuple[str, str] | None:
    """'pkg-1.0/vllm/x.py' -> ('pkg-1.0/', 'vllm/x.py') when it is a wanted path."""
    name = name[2:] if name.startswith("./") else name
    for rel in wanted:
        if name == rel:
            return "", rel
        if name.endswith("/" + rel):
            return name[: -len(rel)], rel
    return None


def package_prefix(names: Iterable[str]) -> str | None:
    """Archive prefix of the top-most vllm package (shortest path to vllm/__init__.py)."""
    prefixes = []
    for name in names:
        name = name[2:] if name.startswith("./") else name
        if name == "vllm/__init__.py" or name.endswith("/vllm/__init__.py"):
            prefixes.append(name[: -len("vllm/__init__.py")])
    return min(prefixes, key=len) if prefixes else None


@dataclass
class ArchiveScan:
    """What one pass over an archive collected: candidate files and metadata texts."""
    names: list[str] = field(default_factory=list)
    files: dict[tuple[str, str], str] = field(default_factory=dict)   # (prefix, rel) -> text
    metadata: list[str] = field(default_factory=list)                  # METADATA / PKG-INFO


def is_metadata_member(name: str) -> bool:
    parts = name.strip("/").split("/")
    if len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] == "METADATA":
        return True
    return len(parts) <= 2 and parts[-1] == "PKG-INFO"


def scan_zip(path: Path) -> ArchiveScan:
    scan = ArchiveScan()
    wanted = wanted_members()
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            scan.names.append(info.filename)
            hit = split_member(info.filename, wanted)
            meta = is_metadata_member(info.filename)
            if (hit or meta) and info.file_size <= MAX_MEMBER_BYTES:
                keep_member(scan, hit, archive.read(info))
    return scan


def keep_member(scan: ArchiveScan, hit: str | None, data: bytes) -> None:
    """A wanted source file goes under its package path; anything else read is metadata."""
    text = data.decode("utf-8", errors="replace")
    if hit:
        scan.files[hit] = text
    else:
        scan.metadata.append(text)


def scan_tar(path: Path) -> ArchiveScan:
    scan = ArchiveScan()
    wanted = wanted_members()
    # Stream mode: one sequential pass over the compressed file, nothing written to disk.
    with tarfile.open(path, mode="r|*") as archive:
        for member in archive:
            name = member.name[2:] if member.name.startswith("./") else member.name
            scan.names.append(name)
            if not member.isfile() or member.size > MAX_MEMBER_BYTES:
                continue
            hit = split_member(name, wanted)
            if hit or is_metadata_member(name):
                handle = archive.extractfile(member)
                keep_member(scan, hit, handle.read() if handle else b"")
    return scan


def scan_archive(path: Path) -> ArchiveScan:
    try:
        if zipfile.is_zipfile(path):
            return scan_zip(path)
        return scan_tar(path)
    except (zipfile.BadZipFile, tarfile.TarError, OSError, EOFError, ValueError,
            zlib.error) as exc:
        raise AuditError(f"Cannot read {path} as a .whl/.zip or .tar.gz archive ({exc}); "
                         "re-download it or pass a valid vLLM wheel or sdist.") from exc


def audit_archive(path: str | Path) -> AuditResult:
    p = Path(path).expanduser()
    if not p.is_file():
        raise AuditError(f"{p} does not exist or is not a file; pass --wheel an existing vLLM "
                         ".whl, .zip or .tar.gz.")
    scan = scan_archive(p)
    prefix = package_prefix(scan.names)
    if prefix is None:
        raise AuditError(f"No vllm package (vllm/__init__.py) inside {p}; pass --wheel a vLLM "
                         "wheel or sdist.")

    def read(rel: str) -> str | None:
        return scan.files.get((prefix, rel))

    version = first_version([
        *[(lambda t=t: version_from_metadata(t)) for t in scan.metadata],
        lambda: version_from_module(read("vllm/_version.py")),
        lambda: version_from_module(read("vllm/version.py")),
        lambda: version_from_archive_name(p),
    ])
    return AuditResult(source=str(p), kind="archive", version=version, checks=judge_all(read))


def audit(path: str | Path | None = None, wheel: str | Path | None = None) -> AuditResult:
    """The CLI's entry: --wheel FILE, else --path DIR, else the installed package."""
    if wheel is not None:
        return audit_archive(wheel)
    if path is not None:
        return audit_directory(path)
    return audit_installed()


# --------------------------------------------------------------------------- verdicts

def missing_required(result: AuditResult, required_ids: Iterable[str]) -> list[str]:
    """Required fixes the audited source does not carry, in the order asked.

    Anything not "present" is missing -- including "not-applicable": the user named the fix,
    and a version without the file the fix lives in cannot be carrying it. Fixes the user
    did not ask for never count, whatever their state. Unknown ids raise AuditError so a
    typo cannot make a gate pass.
    """
    missing: list[str] = []
    for fix_id in required_ids:
        fix = find_fix(fix_id)
        try:
            state = result.check(fix.fix_id).state
        except KeyError:
            state = NOT_APPLICABLE
        if state != PRESENT and fix.fix_id not in missing:
            missing.append(fix.fix_id)
    return missing


# --------------------------------------------------------------------------- rendering

STATE_STYLE = {PRESENT: "green", ABSENT: "bold red", NOT_APPLICABLE: "dim"}


def render(result: AuditResult, console: Any) -> None:
    """Render the audit as a rich table on the given rich Console."""
    # rich is needed only to show results, not to compute them.
    from rich.table import Table
    from rich.text import Text

    version = result.version or "unknown version"
    table = Table(title=f"vLLM {version} ({result.kind}: {result.source})", show_lines=False)
    table.add_column("fix", no_wrap=True)
    table.add_column("title")
    table.add_column("state", no_wrap=True)
    table.add_column("file:line", overflow="fold")
    table.add_column("evidence")
    for c in result.checks:
        where = f"{c.file}:{c.line}" if c.line is not None else c.file
        style = STATE_STYLE.get(c.state, "")
        # Text cells, not markup: evidence quotes code such as `w[: n]`, which rich would
        # otherwise read as style tags.
        table.add_row(Text(f"#{c.fix_id}"), Text(c.title), Text(c.state, style=style),
                      Text(where), Text(c.evidence))
    console.print(table)
