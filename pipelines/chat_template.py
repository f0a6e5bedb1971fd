"""Chat templates: conversations rendered as the model was trained to read them.

A chat template is the Jinja text a Hugging Face checkpoint ships (in
`chat_template.jinja`, or under "chat_template" in
`tokenizer_config.json`), rendered the way transformers'
`apply_chat_template` renders it: a sandboxed environment with
`trim_blocks` and `lstrip_blocks`, the loop-control extension, a
`tojson` filter that keeps non-ASCII text, the `raise_exception` and
`strftime_now` globals, and the special tokens (`bos_token`,
`eos_token`, ...) as variables. A model without one (any model tfgpt
pretrained) takes `DEFAULT_TEMPLATE`: ChatML's turns,
`<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`.

What a model learns of a conversation: its assistant turns. `segments`
cuts the rendered text into pieces, each learned or not, by rendering the
conversation up to each assistant turn with the generation prompt (what
comes before the reply) and up to the end of that turn (the reply and
its end-of-turn marker, which the model must learn to stop). A template
whose shorter renderings are not prefixes of the longer ones cannot be
cut so, and is refused.

Example:
>>> template = ChatTemplate(DEFAULT_TEMPLATE)
>>> template.segments([{"role": "user", "content": "Hi"},
...                    {"role": "assistant", "content": "Hello."}])
[('<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n', False), \
('Hello.<|im_end|>\\n', True)]
>>> template.end_of_turn()
'<|im_end|>'
"""

import datetime
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

from pipelines.errors import DataError

DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ROLES = ("system", "user", "assistant")
TEMPLATE_FILE = "chat_template.jinja"  # where a tfgpt run or data directory keeps its template
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                   "mask_token")
_REPLY = "\x00tfgpt reply\x00"  # a reply no conversation holds (end_of_turn)


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`, which some templates mark
        their replies with: rendered as its body (`segments` finds replies
        by rendering, not by these marks)."""

        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=line)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda form: datetime.datetime.now().strftime(form)
    return environment


class ChatTemplate:
    """A chat template and the special tokens it is rendered with.

    Args:
        source: str. The Jinja text.
        special_tokens: dict of str. `bos_token`, `eos_token`, ... as the
            template reads them.
        where: str. Where the template came from, for errors.
    """

    def __init__(self, source: str, special_tokens: Optional[Dict[str, str]] = None,
                 where: str = "the default chat template"):
        import jinja2

        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.where = where
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"{where}: the chat template does not parse: {error.message} "
                             f"(template line {error.lineno})") from None

    def spec(self) -> dict:
        """What rebuilds it (`ChatTemplate(**spec)`), as JSON."""
        return {"source": self.source, "special_tokens": self.special_tokens, "where": self.where}

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as text; ValueError naming the template when it fails."""
        import jinja2

        try:
            return self._template.render(messages=list(messages), tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.TemplateError as error:
            raise ValueError(f"{self.where}: the chat template failed to render: "
                             f"{error}") from None

    def segments(self, messages: Sequence[dict]) -> List[Tuple[str, bool]]:
        """`[(text, learned)]`: the rendered conversation cut at its assistant
        turns (learned) and the rest (not); ValueError when the template
        fails or does not render conversations as prefixes of each other."""
        whole = self.render(messages)
        pieces, done = [], 0
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:turn], add_generation_prompt=True)
            through = self.render(messages[: turn + 1])
            if not (through.startswith(before) and whole.startswith(through)
                    and len(before) >= done):
                raise ValueError(
                    f"{self.where}: the chat template does not render a conversation's first "
                    f"turns as the start of the whole (turn {turn + 1}), so its replies cannot "
                    "be told apart from the rest")
            pieces += [(whole[done:len(before)], False), (whole[len(before):len(through)], True)]
            done = len(through)
        pieces.append((whole[done:], False))
        return [(text, learned) for text, learned in pieces if text]

    def turn_pieces(self) -> Dict[str, str]:
        """The text around each turn of a conversation that ends with the user's
        turn and the generation prompt: `{"start|ROLE": before the first
        content, "PREVIOUS|ROLE": between two turns' contents, "end|user":
        after the last}`, for the orders system, user, assistant, user, ...
        `tfgpt.export` renders conversations from them in TensorFlow ops.

        Raises ValueError when the template is not made of such pieces (it
        changes a content, say by trimming it, or moves one): rebuilt
        conversations are checked against its own renderings.
        """
        marks = [f"\x00{index}\x00" for index in range(4)]

        def cut(messages):
            text = self.render(messages, add_generation_prompt=True)
            pieces = []
            for mark in [m["content"] for m in messages]:
                head, found, text = text.partition(mark)
                if not found or mark in text:
                    raise ValueError(f"{self.where}: the chat template does not render each "
                                     "message's content once, in order, so it cannot be "
                                     "exported as pieces around the turns")
                pieces.append(head)
            return pieces + [text]

        roles = ["system", "user", "assistant", "user"]
        full = cut([{"role": role, "content": mark} for role, mark in zip(roles, marks)])
        pieces = {"start|system": full[0], "system|user": full[1], "user|assistant": full[2],
                  "assistant|user": full[3], "end|user": full[4]}
        pieces["start|user"] = cut([{"role": "user", "content": marks[0]}])[0]
        samples = [["user"], ["system", "user"], ["user", "assistant", "user"],
                   ["system", "user", "assistant", "user", "assistant", "user"]]
        for order in samples:
            messages = [{"role": role, "content": f" {role} {index}\n said "}
                        for index, role in enumerate(order)]
            rebuilt = "".join(pieces[f"{previous}|{message['role']}"] + message["content"]
                              for previous, message in zip(["start"] + order, messages))
            if rebuilt + pieces["end|user"] != self.render(messages, add_generation_prompt=True):
                raise ValueError(
                    f"{self.where}: the chat template does not render a conversation as fixed "
                    f"text around each turn's content (checked on the roles {order}), so it "
                    "cannot be exported as pieces around the turns")
        return pieces

    def end_of_turn(self) -> str:
        """What the template puts after a reply (e.g. `<|im_end|>`), stripped of
        white space: where a generated reply ends. Empty when nothing follows."""
        text = self.render([{"role": "user", "content": "?"},
                            {"role": "assistant", "content": _REPLY}])
        return text[text.index(_REPLY) + len(_REPLY):].strip()


def check_messages(messages, where: str) -> List[dict]:
    """The `messages` of one example, checked: a non-empty list of
    `{"role", "content"}` with known roles and string contents, holding an
    assistant turn to learn; DataError naming `where` otherwise."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: "messages" must be a non-empty list of '
                        '{"role": ..., "content": ...}')
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            raise DataError(f'{where}: message {index + 1} must be an object with "role" and '
                            f'"content", got {json.dumps(message)[:80]}')
        if message["role"] not in ROLES:
            raise DataError(f"{where}: message {index + 1} has the role {message['role']!r}; "
                            f"expected one of {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise DataError(f'{where}: message {index + 1}\'s "content" must be a string, got '
                            f"{type(message['content']).__name__}")
    if not any(message["role"] == "assistant" for message in messages):
        raise DataError(f"{where}: no assistant turn: nothing to learn")
    return messages


def _token_text(value):
    """A special token as tokenizer_config.json writes it: a string, or an
    object whose "content" is one."""
    return value.get("content") if isinstance(value, dict) else value


def load_chat_template(path: Optional[str]) -> Optional[ChatTemplate]:
    """The chat template of `path`: a Jinja file, or a directory holding
    `chat_template.jinja` or a `tokenizer_config.json` with one (a Hugging
    Face checkpoint), or a tfgpt run whose `config.json` keeps the one its
    data was prepared with; None when it has none. Special tokens come from
    the `tokenizer_config.json` beside it."""
    if path is None:
        return None
    run_config = os.path.join(path, "config.json")
    if os.path.isfile(run_config):
        with open(run_config, encoding="utf-8") as file:
            spec = json.load(file).get("chat_template")
        if isinstance(spec, dict):
            return ChatTemplate(**spec)
    if os.path.basename(path) == "tokenizer_config.json":
        directory, jinja_file = os.path.dirname(path), None
    elif os.path.isfile(path):
        directory, jinja_file = os.path.dirname(path), path
    else:
        directory, jinja_file = path, os.path.join(path, TEMPLATE_FILE)
    config_file = os.path.join(directory, "tokenizer_config.json")
    config = {}
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as file:
            config = json.load(file)
    special = {name: _token_text(config[name]) for name in _SPECIAL_TOKENS
               if isinstance(_token_text(config.get(name)), str)}
    if jinja_file is not None and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as file:
            return ChatTemplate(file.read(), special, where=jinja_file)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        named = {entry.get("name"): entry.get("template") for entry in source}
        source = named.get("default")
    if isinstance(source, str):
        return ChatTemplate(source, special, where=config_file)
    return None


def chat_template_of(path: Optional[str]) -> ChatTemplate:
    """`load_chat_template(path)`, else the default template."""
    return load_chat_template(path) or ChatTemplate(DEFAULT_TEMPLATE)
