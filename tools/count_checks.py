"""Count the code lines of kvlib's core, serving and checkpoints that are input checks.

    python tools/count_checks.py [ROOT] [-v]      # -v: every file

A code line is a line with a token that is not a comment or a docstring. A code line is a
check when it belongs to

- a function whose name starts with a check prefix (_check, check_, _require, as_, ...): all
  of it, kvlib.checks' functions included (but NOT_CHECKS);
- a raise or an assert statement; an if whose body (and else) only raises; a try whose
  handlers only raise around a single statement;
- a call of a check: a function of kvlib.checks (checks.x(...), or a name with a check prefix
  or one of its former names), wherever the call sits: a statement of its own, or inside an
  expression (``return table[as_token_ids(ids, V)]``), and also the lines of that statement.

Groups: core = kvlib/*.py except plots.py; serving = kvlib/serving/*.py; checkpoints =
kvlib/checkpoints/*.py. The share is check lines / code lines.
"""
import ast
import io
import sys
import tokenize
from pathlib import Path

CHECK_PREFIXES = ("_check", "_require", "check_", "require_", "as_", "_as_", "_validate",
                  "validate")
CHECK_MODULE_NAMES = {"whole_number", "count", "real_number", "flag", "numbers", "whole_numbers",
                      "contains_bool", "check_positions", "check_ids"}

NOT_CHECKS = ("check_positions", "as_dict")
"""Functions named like checks that are not, defined or called: a dataclass's as_dict converts,
it checks nothing (and check_positions, as the first version of this tool counted it)."""


def code_lines(text):
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                        tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        for n in range(tok.start[0], tok.end[0] + 1):
            lines.add(n)
    return lines

def span(node):
    return set(range(node.lineno, node.end_lineno + 1))

def is_check_call(node):
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "checks":
        return True
    return (name in CHECK_MODULE_NAMES or name.startswith(CHECK_PREFIXES)) and \
        name not in NOT_CHECKS

def only_raises(body):
    return body and all(isinstance(s, ast.Raise) or (isinstance(s, ast.If) and only_raises(s.body)
                        and (not s.orelse or only_raises(s.orelse))) for s in body)

def check_lines(tree):
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith(CHECK_PREFIXES) \
                and node.name not in NOT_CHECKS:
            out |= span(node)
        elif isinstance(node, (ast.Raise, ast.Assert)):
            out |= span(node)
        elif isinstance(node, ast.If) and only_raises(node.body) and \
                (not node.orelse or only_raises(node.orelse)):
            out |= span(node)
        elif isinstance(node, ast.Try) and all(only_raises(h.body) for h in node.handlers) \
                and len(node.body) == 1:
            out |= span(node)
        elif isinstance(node, (ast.Expr, ast.Assign, ast.AnnAssign)) and \
                is_check_call(node.value if not isinstance(node, ast.AnnAssign) else node.value):
            out |= span(node)
        elif is_check_call(node):        # a check inside an expression: the call's lines
            out |= span(node)
    return out

def docstring_lines(tree):
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                out |= span(node.body[0])
    for node in ast.walk(tree):   # attribute docstrings
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and \
                isinstance(node.value.value, str):
            out |= span(node)
    return out

def measure(paths):
    total = checks = 0
    rows = []
    for path in paths:
        text = path.read_text()
        tree = ast.parse(text)
        code = code_lines(text) - docstring_lines(tree)
        chk = check_lines(tree) & code
        rows.append((str(path), len(code), len(chk)))
        total += len(code)
        checks += len(chk)
    return total, checks, rows

if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    groups = {"core": [p for p in sorted((root / "kvlib").glob("*.py"))
                       if p.name not in ("plots.py",)],
              "serving": sorted((root / "kvlib/serving").glob("*.py")),
              "checkpoints": sorted((root / "kvlib/checkpoints").glob("*.py"))}
    T = C = 0
    for name, paths in groups.items():
        t, c, rows = measure(paths)
        T += t
        C += c
        print(f"{name}: {c}/{t} = {c/t:.0%}")
        if "-v" in sys.argv:
            for r in rows:
                print(f"   {r[0]}: {r[2]}/{r[1]} = {r[2]/max(r[1],1):.0%}")
    print(f"all: {C}/{T} = {C/T:.0%}")
