"""Export a GPT and its tokenizer as a TensorFlow SavedModel for serving.

Usage:
    python -m tfgpt.export --checkpoint runs/demo --output exported/demo \\
        --max-new-tokens 64 [--temperature 0.8 --top-k 40 --top-p 0.95 --seed 1]

The SavedModel has two signatures:

- `serving_default` (also `generate`): `prompts`, tf.string (B,) ->
  `completions` tf.string (B,) (the generated text only), `texts` tf.string
  (B,) (prompt and completion decoded together), `token_ids` int32 (B, N)
  (new ids; the stop token, if one was generated, then -1) and `lengths`
  int32 (B,) (new ids before the stop token). Tokenization and
  detokenization are TensorFlow ops inside the graph.
- `logits`: `token_ids` int32 (B, T) -> `logits` float32 (B, T, V), the
  model's forward pass. Right padding needs no mask: position t only sees
  positions <= t.
- `chat` (with `--chat`): `roles` and `contents` tf.string (B, M), one
  conversation a row (system first if any, then user and assistant turns
  in turn, ending with the user's; roles "" pad a row's end) -> `replies`
  tf.string (B,) (the reply, cut at the template's end-of-turn marker),
  `prompts` tf.string (B,) (the rendered conversation). The model's chat
  template (`pipelines.chat_template`: the run's, a Hugging Face
  directory's, else ChatML's turns) is rendered by TensorFlow string ops
  from the fixed text it puts around each turn's content; a template that
  is not made of such pieces is refused at export. A row with another
  order of roles fails the call with an InvalidArgumentError.

The decoding settings are baked in at export time: N = `max_new_tokens`,
`temperature`, `top_k`, `top_p`, `seed` (a sampled export gives the same
completion for the same prompt; export with another seed for another
stream) and the stop token (the tokenizer's end-of-text id unless
`stop_at_eos=False`). Prompts longer than `max_sequence_length -
max_new_tokens` tokens keep their last tokens; an empty prompt starts from
the end-of-text id (or id 0 if the tokenizer has none).

Loading needs TensorFlow Text's ops registered first:
    import tensorflow_text  # noqa: F401
    generator = tf.saved_model.load("exported/demo")
    generator.signatures["serving_default"](prompts=tf.constant(["Hello"]))
"""

import argparse
import re
import sys

from tfgpt.cli import HelpFormatter
from tfgpt.generate import add_sampling_flags


def parse_args(argv=None):
    """The command line of `python -m tfgpt.export`."""
    parser = argparse.ArgumentParser(
        prog="python -m tfgpt.export", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--checkpoint", required=True, metavar="DIR",
        help="a tfgpt run directory or a Hugging Face GPT-2 directory (with its tokenizer)",
    )
    parser.add_argument(
        "--output", required=True, metavar="DIR", help="SavedModel directory to write"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, required=True, metavar="N",
        help="tokens the exported model generates per prompt (baked in)",
    )
    add_sampling_flags(parser)
    parser.add_argument(
        "--seed", type=int, default=0,
        help="seed of the sampling: the same prompt gets the same completion",
    )
    parser.add_argument(
        "--ignore-eos", action="store_true",
        help="do not stop a row at the tokenizer's end-of-text id",
    )
    parser.add_argument(
        "--xla", action="store_true",
        help="compile the decode loop (not the tokenizer) with XLA",
    )
    parser.add_argument(
        "--chat", action="store_true",
        help="add the `chat` signature: conversations in, replies out, with the model's chat "
        "template",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    # `--help` and flag errors are answered here, before TensorFlow loads below.
    parse_args()

import tensorflow as tf  # noqa: E402

from tfgpt import decoding, kernels  # noqa: E402
from tfgpt.graph_function import graph_function  # noqa: E402


class GenerationModule(tf.Module):
    """The exported object: the model, the in-graph tokenizer and two functions.

    Args:
        model: a `tfgpt.GPT`.
        tokenizer: a tokenizer with `tf_tokenizer()` (a `BytePairTokenizer` or
            `pipelines.tokenizer.Tokenizer`) and `eos_id`.
        max_new_tokens: int. New tokens per prompt.
        temperature, top_k, top_p, seed: the decoding settings of
            `tfgpt.decoding.generate` (`seed` must be an int here).
        stop_at_eos: bool. End a row at the tokenizer's end-of-text id.
        jit_compile: bool. Compile the decode loop (not the tokenizer) with XLA.
        chat_template: `pipelines.chat_template.ChatTemplate` of the `chat`
            function, or None for none.
    """

    def __init__(
        self,
        model,
        tokenizer,
        max_new_tokens,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=0,
        stop_at_eos=True,
        jit_compile=False,
        chat_template=None,
    ):
        super().__init__(name="tfgpt_generator")
        if seed is None:
            raise ValueError("An export needs a fixed `seed`. Received: seed=None")
        # A one-token prompt must fit with the new tokens.
        decoding.validate_arguments(model, [[0]], max_new_tokens, temperature, top_k, top_p, seed)
        self.model = model
        self.tokenizer = tokenizer.tf_tokenizer()
        eos_id = tokenizer.eos_id if tokenizer.eos_id is not None else -1
        self._start_id = max(eos_id, 0)
        self._max_prompt_length = model.max_sequence_length - max_new_tokens
        # Plain Python values captured by the closure, so that tf.Module does
        # not wrap them as trackable lists.
        top_k = min(int(top_k), model.vocabulary_size)
        seed = [int(seed) % 2**31, 0]
        stop_token_ids = [eos_id] if stop_at_eos and eos_id >= 0 else []

        def run_decoder(token_ids, prompt_lengths):
            return decoding.decode(
                self.model,
                token_ids,
                prompt_lengths,
                int(max_new_tokens),
                tf.constant(float(temperature)),
                tf.constant(top_k),
                tf.constant(float(top_p)),
                tf.constant(seed, tf.int32),
                tf.constant(stop_token_ids, tf.int32, shape=[len(stop_token_ids)]),
            )

        self._decode = graph_function(run_decoder, jit_compile=jit_compile)
        if chat_template is not None:
            pieces = chat_template.turn_pieces()
            bos = chat_template.special_tokens.get("bos_token")
            if bos and tokenizer.encode(""):  # the tokenizer puts the BOS first itself
                pieces = {key: value[len(bos):] if key.startswith("start|")
                          and value.startswith(bos) else value for key, value in pieces.items()}
            keys, values = zip(*pieces.items())
            # An attribute, so that the SavedModel tracks (and saves) the table.
            self._turn_pieces = tf.lookup.StaticHashTable(
                tf.lookup.KeyValueTensorInitializer(list(keys), list(values)),
                default_value=_NO_PIECE)
            self._end_of_turn = chat_template.end_of_turn()
            # Only a module with a template has `chat` (the SavedModel traces
            # every function it finds).
            self.chat = tf.function(self._reply, input_signature=[
                tf.TensorSpec([None, None], tf.string, name="roles"),
                tf.TensorSpec([None, None], tf.string, name="contents")])

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="prompts")])
    def generate(self, prompts):
        prompt_ids = self.tokenizer.tokenize(prompts)  # (B, None)
        prompt_ids = tf.cast(_prepare_prompts(prompt_ids, self._max_prompt_length, self._start_id), tf.int32)
        token_ids, prompt_lengths = _left_pad(prompt_ids)  # (B, P), (B,)
        generated, lengths = self._decode(token_ids, prompt_lengths)  # (B, N), (B,)
        new_ids = tf.RaggedTensor.from_tensor(generated, lengths=lengths)  # (B, None)
        return {
            "completions": self.tokenizer.detokenize(new_ids),
            "texts": self.tokenizer.detokenize(tf.concat([prompt_ids, new_ids], axis=1)),
            "token_ids": generated,
            "lengths": lengths,
        }

    def _reply(self, roles, contents):
        """`chat`: conversations (B, M) -> their replies and prompts (B,)."""
        prompts = _render_turns(roles, contents, self._turn_pieces)  # (B,)
        completions = self.generate(prompts)["completions"]  # (B,)
        if self._end_of_turn:  # the reply ends where the template ends a turn
            completions = tf.strings.regex_replace(
                completions, "(?s)" + re.escape(self._end_of_turn) + ".*", "")
        return {"replies": completions, "prompts": prompts}

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32, name="token_ids")])
    def logits(self, token_ids):
        return {"logits": self.model(token_ids)}


def export(
    model,
    tokenizer,
    directory,
    max_new_tokens,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    seed=0,
    stop_at_eos=True,
    jit_compile=False,
    chat_template=None,
):
    """Writes the SavedModel described in the module docstring to `directory`.

    Returns the exported `GenerationModule`, whose `generate(prompts)` and
    `logits(token_ids)` can also be called directly in Python.
    """
    module = GenerationModule(
        model,
        tokenizer,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop_at_eos=stop_at_eos,
        jit_compile=jit_compile,
        chat_template=chat_template,
    )
    # Standard TensorFlow ops only: the SavedModel must load where tfgpt's
    # fused kernels are not built (TF Serving, another machine).
    with kernels.disabled():
        generate = module.generate.get_concrete_function()
        tf.saved_model.save(
            module,
            directory,
            signatures={
                "serving_default": generate,
                "generate": generate,
                "logits": module.logits.get_concrete_function(),
                **({"chat": module.chat.get_concrete_function()}
                   if chat_template is not None else {}),
            },
        )
    return module


_NO_PIECE = "\x00"  # the lookup of a pair of roles the template has no piece for


def _render_turns(roles, contents, table):
    """Conversations, roles and contents (B, M) ("" roles pad a row's end), as
    text (B,): each content after the piece of its role and the one before
    (`table`: `ChatTemplate.turn_pieces`), and the last piece after them."""
    present = roles != ""  # (B, M)
    previous = tf.concat([tf.fill([tf.shape(roles)[0], 1], "start"), roles[:, :-1]], axis=1)
    leads = table.lookup(tf.strings.join([previous, roles], separator="|"))  # (B, M)
    counts = tf.reduce_sum(tf.cast(present, tf.int32), axis=1)  # (B,)
    last = tf.gather(roles, tf.maximum(counts - 1, 0), batch_dims=1)  # (B,)
    ends = table.lookup(tf.strings.join(["end", last], separator="|"))  # (B,)
    # Roles in an order the template's pieces do not cover, a row that does
    # not end with the user's turn, or padding before a turn.
    valid = tf.reduce_all(tf.logical_or(~present, leads != _NO_PIECE)) & tf.reduce_all(
        ends != _NO_PIECE) & tf.reduce_all(
        tf.reduce_sum(tf.cast(present, tf.int32), axis=1) == counts) & tf.reduce_all(
        tf.equal(present, tf.sequence_mask(counts, tf.shape(roles)[1])))
    check = tf.debugging.Assert(valid, [
        "chat: each row's roles must be [system,] user, assistant, user, ..., user, padded "
        "with \"\" at the end; got", roles], summarize=64)
    with tf.control_dependencies([check]):
        turns = tf.where(present, tf.strings.join([leads, contents]), "")  # (B, M)
        return tf.strings.join([tf.strings.reduce_join(turns, axis=1), ends])


def _prepare_prompts(prompt_ids, max_length, start_id):
    """Keeps each row's last `max_length` ids; an empty row becomes [start_id]."""
    lengths = prompt_ids.row_lengths()  # (B,)
    kept = tf.minimum(lengths, max_length)
    starts = prompt_ids.row_starts() + lengths - kept
    indices = tf.ragged.range(starts, starts + kept)  # (B, None)
    prompt_ids = tf.gather(prompt_ids.flat_values, indices)
    empty = tf.cast(kept == 0, tf.int64)
    start = tf.RaggedTensor.from_row_lengths(
        tf.fill([tf.reduce_sum(empty)], tf.cast(start_id, prompt_ids.dtype)), empty
    )
    return tf.concat([start, prompt_ids], axis=1)


def _left_pad(prompt_ids):
    """Ragged (B, None) ids -> left-padded (B, P) int32 and lengths (B,) int32."""
    lengths = tf.cast(prompt_ids.row_lengths(), tf.int32)
    right_padded = prompt_ids.to_tensor(0)  # (B, P)
    width = tf.shape(right_padded)[1]
    source = tf.range(width)[tf.newaxis, :] - (width - lengths)[:, tf.newaxis]  # (B, P)
    left_padded = tf.gather(right_padded, tf.maximum(source, 0), batch_dims=1)
    return tf.where(source >= 0, left_padded, 0), lengths


def main(argv=None):
    args = parse_args(argv)

    from pipelines.chat_template import chat_template_of
    from tfgpt.loading import load_model

    model, tokenizer = load_model(args.checkpoint)
    if tokenizer is None:
        raise ValueError(f"No tokenizer in {args.checkpoint}: an export needs one")
    export(
        model,
        tokenizer,
        args.output,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_at_eos=not args.ignore_eos,
        jit_compile=args.xla,
        chat_template=chat_template_of(args.checkpoint) if args.chat else None,
    )
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
