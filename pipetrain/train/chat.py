"""A tokenizer folder's chat template, rendered as transformers' `apply_chat_template` renders it, with the
character spans of the assistant's turns.

Rendering: jinja2 (a dependency, as it is transformers') in the environment transformers compiles chat
templates in (transformers/utils/chat_template_utils.py, `_cached_compile_jinja_template`): a sandbox with
trim_blocks and lstrip_blocks, the loopcontrols extension, `raise_exception`, `strftime_now`, a `tojson` that
does not escape HTML, and the `{% generation %}` tag; the variables are the messages, tools=None,
documents=None, add_generation_prompt and the folder's special tokens (bos_token, eos_token, ...). The
text is then tokenized without added special tokens, as apply_chat_template does. We render it ourselves
rather than import transformers at run time: transformers is a test-only dependency (tests compare the two
token for token, tests/test_sft.py), and its import costs seconds on every rank.

The assistant's spans: a template with `{% generation %}` marks them itself (what transformers'
return_assistant_tokens_mask reads); for one without (most shipped templates), assistant message i spans
from the end of the conversation up to i rendered with add_generation_prompt=True to the end of the
conversation up to and including i: the header the template writes for an answer is the prompt's, what
follows is the answer and its end-of-turn tokens. That needs a template that renders every prefix of a
conversation as a prefix of its rendering; one that does not (e.g. one dropping earlier turns' reasoning)
is refused naming the row, with the fix. A token is the assistant's if it overlaps a span (transformers'
rule for assistant_masks).
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Iterator, Optional

GENERATION = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
Span = tuple[int, int]  # [start, end) characters of the rendered text


def _environment() -> Any:
    """transformers' chat-template environment (module docstring)."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: records the characters the block renders to."""

        tags = {"generation"}

        def __init__(self, environment: Any) -> None:
            super().__init__(environment)
            environment.extend(generation_spans=None)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            text = caller()
            tracking = self.environment.generation_spans
            if tracking is not None:
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """One chat template with the special tokens it is given; renders a conversation with its assistant spans."""

    def __init__(self, template: str, special: dict[str, str]) -> None:
        self.source, self.special = template, special
        self.marks = bool(GENERATION.search(template))  # the template marks the assistant's spans itself
        self.env = _environment()
        self.template = self.env.from_string(template)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, tools=None, documents=None,
                                    add_generation_prompt=add_generation_prompt, **self.special)

    @contextmanager
    def _tracking(self, blocks: list[str], spans: list[Span]) -> Iterator[None]:
        self.env.generation_spans = (blocks, spans)
        try:
            yield
        finally:
            self.env.generation_spans = None

    def render_spans(self, messages: list[dict[str, Any]], *, where: str) -> tuple[str, list[Span]]:
        """(the rendered conversation, its assistant spans); one line naming `where` if it fails to render."""
        import jinja2

        try:
            if self.marks:  # as transformers' _render_with_assistant_indices
                blocks: list[str] = []
                spans: list[Span] = []
                with self._tracking(blocks, spans):
                    for block in self.template.generate(messages=messages, tools=None, documents=None,
                                                        add_generation_prompt=False, **self.special):
                        blocks.append(block)
                return "".join(blocks), spans
            text = self.render(messages)
            return text, self._prefix_spans(messages, text, where=where)
        except jinja2.TemplateError as e:
            raise ValueError(f"{where}: the chat template fails to render it ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None

    def _prefix_spans(self, messages: list[dict[str, Any]], text: str, *, where: str) -> list[Span]:
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True) if i else ""
            upto = self.render(messages[:i + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ValueError(f"{where}: the chat template does not render the conversation up to message {i} "
                                 "as the start of the whole (so the assistant's tokens cannot be told): add "
                                 "{% generation %} ... {% endgeneration %} around the assistant's turns in the "
                                 "template, or set data.loss_on=all")
            if len(upto) > len(before):
                spans.append((len(before), len(upto)))
        return spans


def assistant_mask(offsets: list[tuple[int, int]], spans: list[Span]) -> list[int]:
    """1 for each token (character offsets) overlapping an assistant span (transformers' assistant_masks)."""
    mask = [0] * len(offsets)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = 1
    return mask


def load_chat_template(folder: Optional[str]) -> ChatTemplate:
    """The chat template of data.tokenizer_dir with its special tokens (config/sft.py finds them)."""
    from pipetrain.config.sft import chat_template, special_tokens

    return ChatTemplate(chat_template(folder or ""), special_tokens(folder or ""))
