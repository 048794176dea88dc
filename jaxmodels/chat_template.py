"""Chat templates (HF's jinja2 dialect) rendered in jinja2's immutable sandbox, bounded in size and time.

The sandbox stops a hostile template from reaching Python; these bounds stop it from exhausting memory or
hanging: `{{ 'A' * 6000000000 }}`, `{% set ns.s = ns.s ~ ns.s %}` in a loop, `[a, a]` nested forty deep, two
nested `range(100000)` loops. An operation that can build far more than its inputs hold is checked before it
runs, so the one big allocation never happens; everything else is linear in what is already built. Time is
bounded by a deadline checked at each iteration of a loop, call (macros too), filter and operator: between
two checks, no more than one such linear step runs.
"""
from __future__ import annotations

import functools
import re
import time

import jinja2.compiler
import jinja2.sandbox
from jinja2 import nodes
from jinja2.utils import Namespace

MAX_CHARS = 4 << 20  # what a template may print, or build as one value, beyond twice the characters of the messages
MAX_BUILT = 16  # x the above: all the strings it builds, together (real templates: ~4x their messages)
MAX_SECONDS = 5.0
MAX_SOURCE = 128 << 10  # characters of the template itself (real ones: < 40k; jinja2 compiles ~30k a second)
MAX_INT_BITS = 1 << 16  # integers it computes with `*` and `**`


class ChatTemplateError(ValueError):
    """A chat template that fails; the message says why."""


class TemplateLimitError(ChatTemplateError):
    """A chat template that goes past one of the MAX_* bounds."""


def _exceeded(what: str) -> TemplateLimitError:
    return TemplateLimitError(f"the chat template exceeded its bound: {what}")


def _width(w) -> int:
    """A width argument: a number of characters, or a string written that many times (indent's)."""
    return len(w) if isinstance(w, str) else max(int(w or 0), 0)


def _replaced(s: str, old: str, new: str) -> int:
    return len(s) + (s.count(old) if old else len(s) + 1) * len(new)


# Characters that an operation which can build far more than its inputs hold may build, from its arguments.
# Filters get their arguments after any environment / eval context; `join` and `sum` get their input as a list.
_FILTER_GROWTH = {
    "center": lambda env, s, width=80: env.chars(s) + _width(width),
    "indent": lambda env, s, width=4, *_, **__: env.chars(s) + (str(s).count("\n") + 1) * _width(width),
    "replace": lambda env, s, old, new, count=None: _replaced(str(s), str(old), str(new)),
    "wordwrap": lambda env, s, width=79, break_long_words=True, wrapstring=None, *_, **__: (
        env.chars(s) * (1 + len(wrapstring or " "))),  # a break at each character, at worst
    "join": lambda env, items, d="", attribute=None: len(d) * len(items) + sum(map(env.chars, items)),
    "format": lambda env, s, *args, **kwargs: env.formatted(str(s), kwargs or args, "%"),
    "tojson": lambda env, value, indent=None: env.chars(value) * (1 + _width(indent)),
    "batch": lambda env, value, linecount, fill_with=None: _width(linecount),
    "slice": lambda env, value, slices, fill_with=None: _width(slices),
    "sum": lambda env, items, attribute=None, start=0: (  # of lists: quadratic time
        0 if isinstance(start, (int, float)) else len(items) * sum(map(env.chars, items))),
}
_METHOD_GROWTH = {  # of str and bytes
    **dict.fromkeys(["center", "ljust", "rjust"], lambda env, s, width, fill=" ": len(s) + _width(width)),
    "zfill": lambda env, s, width: len(s) + _width(width),
    "expandtabs": lambda env, s, tabsize=8: len(s) * (1 + _width(tabsize)),
    "replace": lambda env, s, old, new, count=-1: _replaced(s, old, new),
    "join": lambda env, s, items: len(s) * len(items) + sum(map(env.chars, items)),
    "translate": lambda env, s, table: len(s) * (1 + env.chars(table)),
}


class _CodeGenerator(jinja2.compiler.CodeGenerator):
    """`a ~ b`, list / tuple / dict literals and what a for loop iterates compile to checked calls of the
    environment: literals because `[a, a]` prints `a` twice, so nested ones grow exponentially."""

    def visit_For(self, node, frame):
        node.iter = nodes.Call(nodes.EnvironmentAttribute("iterate"), [node.iter], [], None, None)
        super().visit_For(node, frame)

    def visit_Concat(self, node, frame):
        self.write("environment.joined(")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(")")

    def _literal(self, visit, node, frame):
        self.write("environment.literal(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node, frame):
        self._literal(super().visit_List, node, frame)

    def visit_Dict(self, node, frame):
        self._literal(super().visit_Dict, node, frame)

    def visit_Tuple(self, node, frame):
        if node.ctx == "load":
            self._literal(super().visit_Tuple, node, frame)
        else:  # a target: {% for a, b in ... %}
            super().visit_Tuple(node, frame)


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, bounded: nothing it builds, nor its output, prints as more than `limit`
    characters, and all the strings it builds stay under MAX_BUILT x `limit`. See the module's docstring."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, limit: int):
        super().__init__(trim_blocks=True, lstrip_blocks=True, finalize=self._printed)
        self.limit, self.built, self._chars, self._held, self._inputs = limit, 0, {}, 0, {}
        self.deadline = time.monotonic() + MAX_SECONDS
        del self.globals["lipsum"]  # random text of any length; no chat template uses it
        self.globals["raise_exception"] = _raise_exception
        self.filters = {k: self._bounded(k, f) for k, f in self.filters.items()}

    def chars(self, x) -> int:
        """About how many characters `x` prints as: a container counts an element each time it holds it."""
        if isinstance(x, (str, bytes)):
            return len(x)
        if not isinstance(x, (list, tuple, dict, set, frozenset, Namespace)):
            return len(str(x))
        held = tuple(x._Namespace__attrs.items()) if isinstance(x, Namespace) else None  # a namespace can change
        if (hit := self._chars.get(id(x)) or self._inputs.get(id(x))) is not None and hit[2] == held:
            return hit[1]
        self._chars[id(x)] = (x, 0, held)  # a container inside itself counts once
        items = [*x, *x.values()] if isinstance(x, dict) else x if held is None else [v for kv in held for v in kv]
        return self._remember(x, 2 + sum(self.chars(v) + 2 for v in items), held)

    def _remember(self, x, n: int, held=None) -> int:
        """n = chars(x), cached. The cache holds x, so the id stays x's; past `limit` references it starts over
        (but for the inputs', `inputs`)."""
        self._held += len(x if held is None else held)
        if self._held > self.limit:
            self._chars, self._held = {}, len(x)
        self._chars[id(x)] = (x, n, held)
        return n

    def inputs(self, **context) -> int:
        """chars() of the render's arguments, whose counts are kept for the whole render."""
        n = self.chars(context)
        self._inputs, self._chars, self._held = self._chars, {}, 0
        return n

    def _tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _exceeded(f"still rendering after {MAX_SECONDS} s")

    def _check(self, n: int, what: str) -> int:
        self._tick()
        if n > self.limit:
            raise _exceeded(f"{what} would be {n:,} characters (at most {self.limit:,})")
        return n

    def _build(self, n: int, what: str) -> None:
        """A string of about n characters is about to be built."""
        self.built += self._check(n, what)
        if self.built > MAX_BUILT * self.limit:
            raise _exceeded(f"it built {self.built:,} characters of strings (at most {MAX_BUILT * self.limit:,})")

    def _container(self, value, what: str):
        if isinstance(value, (list, tuple, dict, Namespace)):
            self._check(self.chars(value), what)
        return value

    def formatted(self, fmt, args, kind: str) -> int:
        """What `fmt % args` (kind "%") or `fmt.format(*args)` ("{") can build: each field the largest argument,
        plus the widths written in fmt, plus the int arguments when a width comes from one (`%*s`, `{:{}}`)."""
        fmt = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
        values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
        fields = re.findall(r"%(?:\([^)]*\))?[^a-zA-Z%]*" if kind == "%" else r"\{[^{}]*", fmt)
        widths = sum(int(d) for f in fields for d in re.findall(r"\d+", f))
        if ("*" in "".join(fields)) if kind == "%" else re.search(r"\{[^{}]*\{", fmt):
            widths += sum(_width(v) for v in values if isinstance(v, int))
        return len(fmt) + widths + len(fields) * max(map(self.chars, values), default=0)

    # ----------------------------------------------------------------- what compiled templates call
    def call_binop(self, context, operator, left, right):
        self._tick()
        sized, size = (str, bytes, list, tuple), None
        text = isinstance(left, (str, bytes)) or isinstance(right, (str, bytes))
        brackets = 0 if text else 2  # a list's or tuple's, which chars() counts
        if operator == "%" and isinstance(left, (str, bytes)):
            self._build(self.formatted(left, right, "%"), "a %-format")
        elif operator in ("*", "**") and isinstance(left, int) and isinstance(right, int):
            bits = left.bit_length() * max(right, 0) if operator == "**" else left.bit_length() + right.bit_length()
            if bits > MAX_INT_BITS:
                raise _exceeded(f"an integer {operator} would have {bits:,} bits (at most {MAX_INT_BITS:,})")
        elif operator == "*" and isinstance(n := right if isinstance(left, sized) else left, int):
            size = max(n, 0) * (self.chars(right if n is left else left) - brackets) + brackets
        elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
            size = self.chars(left) + self.chars(right) - brackets
        if size is not None:
            (self._build if text else self._check)(size, f"a {operator}")  # a string is built; a list holds references
        result = super().call_binop(context, operator, left, right)
        if size is not None and isinstance(result, (list, tuple)):
            self._remember(result, size)  # so that `ns.items + [item]` in a loop stays linear
        return result

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's names, which no keyword can clash with
        __self._tick()
        s, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
        if isinstance(s, (str, bytes)) and name in _METHOD_GROWTH:
            if name == "join" and args:
                args = (list(args[0]),)
            __self._build(_METHOD_GROWTH[name](__self, s, *args, **kwargs), f"str.{name}")
        return __self._container(super().call(__context, __obj, *args, **kwargs), f"what {name or 'a call'} returned")

    def wrap_str_format(self, value):
        format_ = super().wrap_str_format(value)
        if format_ is None:
            return None

        def bounded(*args, **kwargs):
            self._build(self.formatted(value.__self__, (*args, *kwargs.values()), "{"), f"str.{value.__name__}")
            return format_(*args, **kwargs)
        return bounded

    def _bounded(self, name: str, f):
        growth, skip = _FILTER_GROWTH.get(name), 1 if getattr(f, "jinja_pass_arg", None) else 0

        def bounded(*args, **kwargs):
            self._tick()
            if name in ("join", "sum") and len(args) > skip:
                args = (*args[:skip], list(args[skip]), *args[skip + 1:])
            if len(args) > skip and isinstance(args[skip], Namespace):  # the one container that changes
                self._container(args[skip], f"the input of the {name} filter")
            if growth is not None:
                self._build(growth(self, *args[skip:], **kwargs), f"the {name} filter")
            return self._container(f(*args, **kwargs), f"what the {name} filter returned")

        if skip:  # what jinja2 passes first: the environment, eval context or context (functools.wraps: 10x slower)
            bounded.jinja_pass_arg = f.jinja_pass_arg
        return bounded

    def iterate(self, iterable):  # what a for loop iterates
        for item in iterable:
            self._tick()
            yield item

    def joined(self, *values) -> str:  # a ~ b
        self._build(sum(map(self.chars, values)), "a ~")
        return "".join(map(str, values))

    def literal(self, value):
        return self._container(value, "a literal")

    def concat(self, pieces) -> str:  # joins the output, and that of macros, {% set %} and {% filter %} blocks
        out, n = [], 0
        for piece in pieces:
            n = self._check(n + len(piece), "the output")
            out.append(piece)
        self._build(n, "the output")
        return "".join(out)

    def _printed(self, value):  # {{ value }}
        if not isinstance(value, str):
            self._build(self.chars(value), "a printed value")
        return value


def _raise_exception(msg):
    raise ChatTemplateError(f"the chat template refused the messages: {msg}")


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    """Python code of a template, the same for every _Sandbox: compiling costs far more than rendering."""
    return _Sandbox(MAX_CHARS).compile(source)


def render(source: str, messages: list, **context) -> str:
    """`source` rendered with `messages` and `context`; TemplateLimitError past a bound, ChatTemplateError for any
    other failure of the template."""
    if len(source) > MAX_SOURCE:
        raise _exceeded(f"it is {len(source):,} characters long (at most {MAX_SOURCE:,})")
    try:
        code = _compile(source)
        env = _Sandbox(MAX_CHARS)  # the deadline starts here
        env.limit += 2 * env.inputs(messages=messages, **context)
        template = env.template_class.from_code(env, code, env.make_globals(None))
        return env.concat(template.generate(messages=messages, **context))
    except ChatTemplateError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the template does wrong, one clear error
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from e
