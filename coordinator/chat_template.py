"""Chat templates rendered as transformers renders them, without transformers.

A sandboxed Jinja environment with the same settings and helpers transformers gives a template
(trim_blocks, lstrip_blocks, loop controls, a `generation` block, `tojson` without HTML
escaping, `raise_exception`, `strftime_now`, a plain `dict` and a namespace that refuses private
names), so a template renders the same text here as on the worker; the worker's probes check
that before the coordinator serves (coordinator/tokenizer.py).
"""

from __future__ import annotations

import datetime
import functools
import json

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks an assistant's tokens for training): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing names that start with an underscore (no reach into Python's internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


class _PlainDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    if tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit()) < (3, 1, 6):
        raise ImportError(f"jinja2 {jinja2.__version__} has known sandbox escapes; chat templates need jinja2>=3.1.6")
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_PlainDict(), namespace=_Namespace
    )
    return environment.from_string(source)


def render_chat(source: str, messages: list[dict[str, str]], variables: dict) -> str:
    """The conversation as the template writes it, ending in the prompt for the assistant's reply."""
    # tools and documents as transformers passes them when a request has none: None, not undefined
    # (`tools is not none` is true of an undefined name).
    return compile_template(source).render(messages=messages, add_generation_prompt=True, tools=None, documents=None, **variables)
