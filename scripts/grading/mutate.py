"""Mistakes nobody planted: an AST mutator (stdlib ``ast``) of the library's solution functions.

``mutants(function_def)`` makes every single-point mutant of one function, each as
``Mutant(line, description, source)``: the line of the library's file it changes, what it
changed (``"operator: before -> after"``, in source text) and the mutated function's source.
The operators are the mistakes a learner makes:

- ``swap``: the operands of a binary operator that does not commute (``a - b`` -> ``b - a``);
- ``operator``: ``+`` for ``-``, ``*`` for ``/`` and back (in ``a -= b`` too);
- ``constant``: an integer constant +1 and -1 (an off-by-one);
- ``index``: an index or a slice bound that is an expression, +1 and -1;
- ``drop``: a simple statement removed (a wait, a collective, a division, an assignment);
- ``group``: a process-group argument replaced by another group of the function, by the
  world (``dist.group.WORLD``) or by None (comm's functions read None as the world);
- ``method``: an in-place method's inverse (``x.div_(n)`` -> ``x.mul_(n)``, ``add_`` and ``sub_``);
- ``compare``: a comparison negated (``<`` -> ``>=``) or its boundary moved (``<`` -> ``<=``);
- ``if/while``: an ``if`` made a ``while`` and a ``while`` an ``if``;
- ``return``: a returned value's outer operation removed (``return a + b`` -> ``return a``,
  ``return f(x)`` -> ``return x``, ``return -x`` -> ``return x``).

A mutant whose source equals the function's or an earlier mutant's is made once; the same
description at a later site ends in `` (#2)``, `` (#3)``. The docstring
is never mutated. A mutant's source names the world ``WORLD_GROUP``: the file it is put in
imports torch.distributed as ``_dist``.
"""

import ast
import copy
import re
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

WORLD_GROUP = "_dist.group.WORLD"  # a mutant's file imports torch.distributed as _dist
# an argument that is a process group: ``group``, ``self.group``, ``pgm.dp_group``, ``pg``
GROUP = re.compile(r"(^|[._])(group|pg)$|_group$")
_FLIP = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult
}
_NOT_COMMUTING = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.MatMult, ast.LShift,
                  ast.RShift)
_NEGATE = {
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Lt: ast.GtE,
    ast.GtE: ast.Lt,
    ast.Gt: ast.LtE,
    ast.LtE: ast.Gt,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In
}
_BOUNDARY = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
_METHODS = {"div_": "mul_", "mul_": "div_", "add_": "sub_", "sub_": "add_"}
_SIMPLE = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Raise, ast.Assert,
           ast.Delete)


@dataclass(frozen=True)
class Mutant:
    """One mutation of a function: the library's ``line`` it changes, ``description``
    ("operator: before -> after") and the mutated function's ``source``."""
    line: int
    description: str
    source: str


def _text(node: ast.AST) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= 60 else text[:57] + "..."


def _plus(node: ast.expr, step: int) -> ast.expr:
    op = ast.Add() if step > 0 else ast.Sub()
    return ast.BinOp(left=copy.deepcopy(node), op=op, right=ast.Constant(1))


def _world() -> ast.expr:
    return ast.parse(WORLD_GROUP, mode="eval").body


class _Sites(ast.NodeTransformer):
    """Visits a function's nodes in a fixed order, offering each possible mutation a number;
    applies the one numbered ``target`` (and records it), leaves the others."""

    def __init__(self, target: int, groups: Sequence[str]) -> None:
        self.target, self.groups, self.index = target, groups, 0
        self.done: Optional[Mutant] = None

    def offer(self, node: ast.AST, operator: str, make: Callable[[], ast.AST]) -> Optional[ast.AST]:
        index, self.index = self.index, self.index + 1
        if index != self.target:
            return None
        new = make()
        after = "(dropped)" if isinstance(new, ast.Pass) else _text(new)
        self.done = Mutant(getattr(node, "lineno", 0), f"{operator}: {_text(node)} -> {after}", "")
        return new

    def first(self, node: ast.AST, offers: list) -> ast.AST:
        for operator, make in offers:
            new = self.offer(node, operator, make)
            if new is not None:
                return ast.copy_location(new, node)
        return node

    def body(self, statements: List[ast.stmt], docstring: bool) -> List[ast.stmt]:
        out = []
        for k, stmt in enumerate(statements):
            is_doc = docstring and k == 0 and isinstance(stmt, ast.Expr) and \
                isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)
            if is_doc:
                out.append(stmt)
                continue
            stmt = self.visit(stmt)
            if isinstance(stmt, _SIMPLE):
                stmt = self.first(stmt, [("drop", ast.Pass)])
            out.append(stmt)
        return out

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for field, value in ast.iter_fields(node):
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                setattr(node, field, self.body(value, isinstance(node, ast.FunctionDef)))
            elif isinstance(value, list):
                setattr(node, field,
                        [self.visit(v) if isinstance(v, ast.AST) else v for v in value])
            elif isinstance(value, ast.AST):
                setattr(node, field, self.visit(value))
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        node.body = self.body(node.body, True)  # decorators and annotations stay
        return node

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        offers = []
        if isinstance(node.op, _NOT_COMMUTING):
            offers.append(("swap", lambda: ast.BinOp(node.right, node.op, node.left)))
        if type(node.op) in _FLIP:
            offers.append(("operator", lambda: ast.BinOp(node.left, _FLIP[type(node.op)]
                                                         (), node.right)))
        return self.first(node, offers)

    def visit_AugAssign(self, node: ast.AugAssign) -> ast.AST:
        self.generic_visit(node)
        if type(node.op) not in _FLIP:
            return node
        return self.first(node,
                          [("operator", lambda: ast.AugAssign(node.target, _FLIP[type(node.op)]
                                                              (), node.value))])

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if type(node.value) is not int:  # not bool
            return node
        return self.first(node, [("constant", lambda: ast.Constant(node.value + 1)),
                                 ("constant", lambda: ast.Constant(node.value - 1))])

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        self.generic_visit(node)
        index = node.slice
        if isinstance(index, (ast.Name, ast.Attribute, ast.BinOp)):
            return self.first(node, [
                ("index", lambda: ast.Subscript(node.value, _plus(index, 1), node.ctx)),
                ("index", lambda: ast.Subscript(node.value, _plus(index, -1), node.ctx)),
            ])
        if isinstance(index, ast.Slice):
            for bound in ("lower", "upper"):
                value = getattr(index, bound)
                if value is None or isinstance(value, ast.Constant):
                    continue  # a constant bound is the constant operator's
                for step in (1, -1):
                    new = self.offer(
                        node, "index", lambda: ast.Subscript(
                            node.value, ast.Slice(**{
                                **vars(index), bound: _plus(value, step)
                            }), node.ctx))
                    if new is not None:
                        return ast.copy_location(new, node)
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in _METHODS:
            new = self.offer(
                node, "method",
                lambda: ast.Call(ast.Attribute(func.value, _METHODS[func.attr], func.ctx), node.
                                 args, node.keywords))
            if new is not None:
                return ast.copy_location(new, node)
        slots = [(k, a) for k, a in enumerate(node.args)] + \
            [(kw.arg, kw.value) for kw in node.keywords]
        for slot, arg in slots:
            name = slot if isinstance(slot, str) else ""
            text = ast.unparse(arg)
            if not (GROUP.search(text) or GROUP.search(name or "-")):
                continue
            others: List[ast.expr] = [
                ast.parse(g, mode="eval").body for g in self.groups if g != text
            ]
            for value in others + [_world(), ast.Constant(None)]:
                new = self.offer(arg, "group", lambda value=value: value)
                if new is not None:
                    replaced = copy.copy(node)
                    if isinstance(slot, int):
                        replaced.args = [new if k == slot else a for k, a in enumerate(node.args)]
                    else:
                        replaced.keywords = [
                            ast.keyword(kw.arg, new) if kw.arg == slot else kw
                            for kw in node.keywords
                        ]
                    return ast.copy_location(replaced, node)
        return node

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        offers = []
        for k, op in enumerate(node.ops):
            for table, operator in ((_NEGATE, "compare"), (_BOUNDARY, "compare")):
                if type(op) in table:
                    ops = node.ops[:k] + [table[type(op)]()] + node.ops[k + 1:]
                    offers.append(
                        (operator, lambda ops=ops: ast.Compare(node.left, ops, node.comparators)))
        return self.first(node, offers)

    def visit_If(self, node: ast.If) -> ast.AST:
        self.generic_visit(node)
        return self.first(node,
                          [("if/while", lambda: ast.While(node.test, node.body, node.orelse))])

    def visit_While(self, node: ast.While) -> ast.AST:
        self.generic_visit(node)
        return self.first(node, [("if/while", lambda: ast.If(node.test, node.body, node.orelse))])

    def visit_Return(self, node: ast.Return) -> ast.AST:
        self.generic_visit(node)
        value = node.value
        inner: List[ast.expr] = []
        if isinstance(value, ast.BinOp):
            inner = [value.left, value.right]
        elif isinstance(value, ast.UnaryOp):
            inner = [value.operand]
        elif isinstance(value, ast.Call) and value.args:
            inner = [value.args[0]]
        return self.first(node, [("return", lambda v=v: ast.Return(v)) for v in inner])


def _one_line(source: str) -> str:
    return " ".join(source.split())


def group_names(function: ast.FunctionDef) -> List[str]:
    """The process groups a function names (arguments that read like ``group``), in order."""
    names: List[str] = []
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            for arg in list(node.args) + [kw.value for kw in node.keywords]:
                text = ast.unparse(arg)
                if GROUP.search(text) and text not in names:
                    names.append(text)
    return names


def mutants(function: ast.FunctionDef) -> List[Mutant]:
    """Every single-point mutant of ``function`` (not modified), in source order by operator
    site, without duplicates (the same source) or no-ops (the function's own)."""
    groups = group_names(function)
    seen = {_one_line(ast.unparse(function))}
    out: List[Mutant] = []
    target = 0
    while True:
        sites = _Sites(target, groups)
        tree = sites.visit(copy.deepcopy(function))
        if sites.done is None:
            return out
        source = ast.unparse(ast.fix_missing_locations(tree))
        if _one_line(source) not in seen:
            seen.add(_one_line(source))
            described = [m.description.split(" (#")[0] for m in out]
            again = described.count(sites.done.description)  # the same text at another site
            description = sites.done.description + (f" (#{again + 1})" if again else "")
            out.append(Mutant(sites.done.line, description, source))
        target += 1


def function_def(source: str, name: str) -> ast.FunctionDef:
    """The top-level ``def name`` of a module's ``source``."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise KeyError(f"no top-level function {name!r}")
