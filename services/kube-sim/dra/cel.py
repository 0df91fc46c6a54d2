"""CEL device selectors, as the DRA API documents them, on cel-python.

The expression sees one variable, `device`: `driver` (string), `attributes` (domain → name →
value, an unknown domain an empty map), `capacity` (domain → name → quantity) and
`allowMultipleAllocations` (bool). Attribute values keep their type: int, bool, string, and
`version` as a semver value. On top of standard CEL, the Kubernetes libraries the DRA docs list:
`quantity()`/`isQuantity()` with `compareTo`, `isLessThan`, `isGreaterThan`, `add`, `sub`,
`asInteger`, `asApproximateFloat`, `isInteger`, `sign`; `semver()`/`isSemver()` with `major`,
`minor`, `patch`, `compareTo`, `isLessThan`, `isGreaterThan`; and the `cel.bind(var, init,
expr)` macro (expanded before evaluation). Anything but a bool result is an error, which aborts
the allocation (as upstream: "Any other result is an error").
"""

from __future__ import annotations

import copy
import functools
import re
from fractions import Fraction
from typing import Any

import celpy
import celpy.celtypes as ct
from lark import Token, Tree

from tessera.quantity import QuantityError
from tessera.quantity import parse as parse_quantity

MAX_EXPRESSION_BYTES = 10 * 1024
# cel-go aborts an evaluation past its runtime cost limit (the allocation fails with the error).
# cel-python is far slower per step (~10 us), so kube-sim's bound is in evaluation steps (AST
# nodes visited): a selector built to be slow costs about a second of CPU per device, and what
# people write stays far below it (the webhook's 150-type use-gputype selector: ~5,000 steps;
# a 40 x 40 comprehension: ~38,000). A selector past it is refused as cel-go refuses one past
# its cost limit, though cel-go would have finished some of them.
MAX_EVALUATION_STEPS = 100_000


class CelError(ValueError):
    """A selector that does not compile, or does not evaluate to a bool."""


class Quantity:
    """A Kubernetes quantity as a CEL value (exact)."""

    __slots__ = ("text", "value")

    def __init__(self, text: str, value: Fraction) -> None:
        self.text = text
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Quantity) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"quantity({self.text!r})"


_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


class Semver:
    """A semantic version (semver.org 2.0.0) as a CEL value."""

    __slots__ = ("major", "minor", "patch", "pre", "text")

    def __init__(self, text: str) -> None:
        match = _SEMVER.match(text)
        if match is None:
            raise CelError(f"invalid semver {text!r}")
        self.text = text
        self.major, self.minor, self.patch = (int(match.group(i)) for i in (1, 2, 3))
        self.pre = tuple(match.group(4).split(".")) if match.group(4) else ()

    def key(self) -> tuple[Any, ...]:
        # a pre-release sorts before its release; numeric identifiers below alphanumeric ones
        pre = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.pre)
        return (self.major, self.minor, self.patch, 0 if self.pre else 1, pre)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Semver) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        return f"semver({self.text!r})"


def quantity_of(value: Any) -> Quantity:
    try:
        return Quantity(str(value), parse_quantity(str(value)).value)
    except QuantityError as exc:
        raise CelError(f"invalid quantity {value!r}: {exc}") from None


def _cmp(a: Any, b: Any) -> int:
    if isinstance(a, Quantity) and isinstance(b, Quantity):
        return (a.value > b.value) - (a.value < b.value)
    if isinstance(a, Semver) and isinstance(b, Semver):
        return (a.key() > b.key()) - (a.key() < b.key())
    raise CelError(f"no such overload: compare {type(a).__name__} with {type(b).__name__}")


def _fail(name: str) -> Any:
    def call(*args: Any) -> Any:
        raise CelError(f"no such overload: {name}")
    return call


def _functions() -> dict[str, Any]:
    def quantity(text: Any) -> Quantity:
        return quantity_of(text)

    def is_quantity(text: Any) -> ct.BoolType:
        try:
            quantity_of(text)
        except CelError:
            return ct.BoolType(False)
        return ct.BoolType(True)

    def semver(text: Any) -> Semver:
        return Semver(str(text))

    def is_semver(text: Any) -> ct.BoolType:
        return ct.BoolType(_SEMVER.match(str(text)) is not None)

    def arith(sign: int) -> Any:
        def call(a: Any, b: Any) -> Quantity:
            if not isinstance(a, Quantity):
                raise CelError("no such overload: add/sub on a non-quantity")
            other = b.value if isinstance(b, Quantity) else Fraction(int(b))
            value = a.value + sign * other
            return Quantity(str(value), value)
        return call

    def as_integer(q: Quantity) -> ct.IntType:
        if not isinstance(q, Quantity) or q.value.denominator != 1 or abs(q.value) >= 2**63:
            raise CelError("cannot convert value to integer")
        return ct.IntType(int(q.value))

    def version_part(field: str) -> Any:
        def call(v: Semver) -> ct.IntType:
            if not isinstance(v, Semver):
                raise CelError(f"no such overload: {field}")
            return ct.IntType(getattr(v, field))
        return call

    return {
        "quantity": quantity,
        "isQuantity": is_quantity,
        "semver": semver,
        "isSemver": is_semver,
        "compareTo": lambda a, b: ct.IntType(_cmp(a, b)),
        "isLessThan": lambda a, b: ct.BoolType(_cmp(a, b) < 0),
        "isGreaterThan": lambda a, b: ct.BoolType(_cmp(a, b) > 0),
        "add": arith(1),
        "sub": arith(-1),
        "asInteger": as_integer,
        "asApproximateFloat": lambda q: ct.DoubleType(float(q.value)),
        "isInteger": lambda q: ct.BoolType(
            isinstance(q, Quantity) and q.value.denominator == 1 and abs(q.value) < 2**63),
        "sign": lambda q: ct.IntType((q.value > 0) - (q.value < 0)),
        "major": version_part("major"),
        "minor": version_part("minor"),
        "patch": version_part("patch"),
    }


FUNCTIONS = _functions()


class _Domains(ct.MapType):
    """device.attributes / device.capacity: an unknown domain is an empty map."""

    def __getitem__(self, key: Any) -> Any:
        try:
            return super().__getitem__(key)
        except KeyError:
            return ct.MapType()


def _ident(tree: Any) -> str | None:
    """The identifier an expression subtree is, if it is a bare one."""
    while isinstance(tree, Tree) and len(tree.children) == 1 and tree.data != "ident":
        tree = tree.children[0]
    if isinstance(tree, Tree) and tree.data == "ident":
        return str(tree.children[0])
    return None


def _substitute(tree: Any, name: str, value: Tree) -> Any:
    if not isinstance(tree, Tree):
        return tree
    if tree.data == "primary" and _ident(tree) == name:
        return Tree("primary", [Tree("paren_expr", [copy.deepcopy(value)])])
    return Tree(tree.data, [_substitute(c, name, value) for c in tree.children])


def _expand_bind(tree: Any) -> Any:
    """`cel.bind(v, init, body)` → body with v replaced by (init): CEL has no side effects."""
    if not isinstance(tree, Tree):
        return tree
    children = [_expand_bind(c) for c in tree.children]
    if tree.data == "member" and len(children) == 1 and isinstance(children[0], Tree):
        call = children[0]
        if (call.data == "member_dot_arg" and len(call.children) == 3
                and _ident(call.children[0]) == "cel"
                and isinstance(call.children[1], Token) and str(call.children[1]) == "bind"):
            args = call.children[2].children if isinstance(call.children[2], Tree) else []
            if len(args) != 3 or _ident(args[0]) is None:
                raise CelError("cel.bind() requires an identifier, an init and an expression")
            body = _substitute(args[2], str(_ident(args[0])), args[1])
            return Tree("member", [Tree("primary", [Tree("paren_expr", [body])])])
    return Tree(tree.data, children)


class _CostLimitExceeded(BaseException):
    """Raised out of cel-python's evaluator, which turns any Exception inside `||`, `&&` and
    `?:` into a value; caught in `evaluate` only."""


class _CountingEvaluator(celpy.evaluation.Evaluator):
    """cel-python's evaluator, every node visited charged to one budget (macros included)."""

    budget: list[int]

    def sub_evaluator(self, ast: Any) -> celpy.evaluation.Evaluator:
        sub = _CountingEvaluator(ast, activation=self.activation)
        sub.budget = self.budget
        return sub

    def visit_children(self, tree: Any) -> Any:
        self.budget[0] -= 1
        if self.budget[0] < 0:
            raise _CostLimitExceeded
        return super().visit_children(tree)


class _CountingRunner(celpy.InterpretedRunner):
    def evaluate(self, context: Any) -> Any:
        evaluator = _CountingEvaluator(ast=self.ast, activation=self.new_activation())
        evaluator.budget = [MAX_EVALUATION_STEPS]
        return evaluator.evaluate(context)


_ENV = celpy.Environment(runner_class=_CountingRunner)


@functools.lru_cache(maxsize=4096)
def compile_selector(expression: str) -> celpy.Runner:
    """Compile once per expression text (the allocator evaluates it on every device)."""
    if len(expression.encode()) > MAX_EXPRESSION_BYTES:
        raise CelError("expression is longer than 10Ki")
    try:
        tree = _expand_bind(_ENV.compile(expression))
        return _ENV.program(tree, functions=FUNCTIONS)
    except celpy.CELParseError as exc:
        raise CelError(f"compilation failed: {exc}") from None
    except RecursionError:  # cel-go's parser has a recursion limit too ("max recursion depth")
        raise CelError("compilation failed: the expression nests too deeply") from None


def compile_error(expression: str) -> str | None:
    try:
        compile_selector(expression)
    except CelError as exc:
        return str(exc)
    return None


def attribute_value(attribute: dict[str, Any]) -> Any:
    """A DeviceAttribute (exactly one of int, bool, string, version) as a CEL value."""
    if "int" in attribute:
        return ct.IntType(int(attribute["int"]))
    if "bool" in attribute:
        return ct.BoolType(bool(attribute["bool"]))
    if "string" in attribute:
        return ct.StringType(str(attribute["string"]))
    if "version" in attribute:
        return Semver(str(attribute["version"]))
    raise CelError("attribute without a value")


def device_activation(
    driver: str, attributes: dict[str, dict[str, Any]], capacity: dict[str, Fraction],
    allow_multiple: bool,
) -> dict[str, Any]:
    """The `device` variable: qualified names (`domain/name`) grouped by domain."""
    attrs: dict[Any, Any] = {}
    for qualified, attribute in attributes.items():
        domain, _, name = qualified.rpartition("/")
        attrs.setdefault(ct.StringType(domain), ct.MapType())[ct.StringType(name)] = (
            attribute_value(attribute))
    caps: dict[Any, Any] = {}
    for qualified, value in capacity.items():
        domain, _, name = qualified.rpartition("/")
        caps.setdefault(ct.StringType(domain), ct.MapType())[ct.StringType(name)] = Quantity(
            str(value), value)
    return {"device": ct.MapType({
        ct.StringType("driver"): ct.StringType(driver),
        ct.StringType("attributes"): _Domains(attrs),
        ct.StringType("capacity"): _Domains(caps),
        ct.StringType("allowMultipleAllocations"): ct.BoolType(allow_multiple),
    })}


def evaluate(expression: str, activation: dict[str, Any]) -> bool:
    """True/False for a device; CelError for anything else (a compile or runtime error)."""
    program = compile_selector(expression)
    try:
        result = program.evaluate(activation)
    except _CostLimitExceeded:
        raise CelError(f"evaluation failed: actual cost limit exceeded ({MAX_EVALUATION_STEPS} "
                       "steps)") from None
    except (celpy.CELEvalError, CelError) as exc:
        raise CelError(f"evaluation failed: {exc.args[0] if exc.args else exc}") from None
    except Exception as exc:  # cel-python raises plain errors from inside functions
        raise CelError(f"evaluation failed: {exc}") from None
    if isinstance(result, celpy.CELEvalError):
        raise CelError(f"evaluation failed: {result.args[0] if result.args else result}")
    if not isinstance(result, ct.BoolType):
        raise CelError(f"expression must evaluate to a bool, not {type(result).__name__}")
    return bool(result)


_DEVICE_USE = re.compile(r"\bdevice\b")
_FIELD_PATH = re.compile(
    r"\bdevice\s*\.\s*(?:(?:driver|allowMultipleAllocations)\b(?!\s*\()"
    r"|(attributes|capacity)\s*\[\s*\"([^\"\\\\]*)\"\s*\]\s*\.\s*([A-Za-z_]\w*)\b(?!\s*\())")


@functools.lru_cache(maxsize=4096)
def selector_reads(expression: str) -> tuple[tuple[str, str], ...] | None:
    """What of `device` a selector can read, when every use of `device` in its text is a plain
    field path (`device.driver`, `device.allowMultipleAllocations`,
    `device.attributes["<domain>"].<name>`, `device.capacity["<domain>"].<name>`): the
    (attributes|capacity, qualified name) pairs; its result is then the same for every device
    alike in those (and in driver and allowMultipleAllocations). None: any other use (a macro
    over a map, an index by an expression, `device` in a string): the whole device counts."""
    paths = list(_FIELD_PATH.finditer(expression))
    if len(paths) != len(_DEVICE_USE.findall(expression)):
        return None
    return tuple(sorted({(m.group(1), f"{m.group(2)}/{m.group(3)}") for m in paths
                         if m.group(1)}))
