"""Convert between Hugging Face GPT-2 checkpoints and tfgpt's GPT.

What a GPT-2 checkpoint directory holds and how its tensors map onto
tfgpt's are GPT-2's family's to say (`tfgpt.models.gpt2.hf_conversion`);
its functions are importable from here.

Usage:
    python -m tfgpt.convert to-tfgpt GPT2_DIR OUTPUT_DIR
    python -m tfgpt.convert to-gpt2 TFGPT_DIR OUTPUT_DIR
    python -m tfgpt.convert merge ADAPTER_RUN OUTPUT_DIR
    python -m tfgpt.convert to-peft ADAPTER_RUN OUTPUT_DIR --base-model HF_DIR

`to-tfgpt` writes a tfgpt run directory (config.json, with the source's chat
template if it has one, ckpt-0, tokenizer);
`to-gpt2` writes `config.json`, `model.safetensors` and, when the source has
a GPT-2 tokenizer, `vocab.json` and `merges.txt`. Reading safetensors needs
only the `safetensors` package; `pytorch_model.bin` needs PyTorch. `merge`
folds the adapters of a `--lora-rank` run into its base's kernels and writes
a plain tfgpt run directory (config.json, with the run's chat template if it
has one, ckpt-0, tokenizer), which `tfgpt.export`, `to-gpt2` and `--init`
read like any other. `to-peft` writes the adapters of a `--lora-rank` run in
PEFT's LoRA layout (`adapter_config.json`, `adapter_model.safetensors`),
which `peft.PeftModel.from_pretrained` loads onto the transformers base.
"""

import argparse
import json
import os
import sys

from tfgpt.cli import HelpFormatter
from tfgpt.models.decoder_families import MODEL_TYPES


def parse_args(argv=None):
    """The command line of `python -m tfgpt.convert`."""
    parser = argparse.ArgumentParser(
        prog="python -m tfgpt.convert", description=__doc__, formatter_class=HelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    to_tfgpt = commands.add_parser(
        "to-tfgpt", formatter_class=HelpFormatter,
        help="a Hugging Face decoder directory -> a tfgpt run directory",
        description="Reads a Hugging Face GPT-2, GPT-J, GPT-Neo, GPT-NeoX, Llama, Mistral or\n"
        "Qwen2 directory (config.json, safetensors or pytorch_model.bin, its\n"
        "tokenizer) and writes a tfgpt run directory (config.json, ckpt-0, the\n"
        "tokenizer), which tfgpt.generate and train_hvd.py --init read (--init also\n"
        "reads the Hugging Face directory itself).",
    )
    to_gpt2 = commands.add_parser(
        "to-gpt2", formatter_class=HelpFormatter,
        help="a tfgpt run (or GPT-2) directory -> Hugging Face GPT-2's layout",
        description="Reads a tfgpt run directory (or a GPT-2 one) and writes config.json\n"
        "(with the tokenizer's bos and eos ids, null where it has none),\n"
        "model.safetensors and, for a GPT-2 byte-level BPE tokenizer, vocab.json\n"
        "and merges.txt.",
    )
    merge = commands.add_parser(
        "merge", formatter_class=HelpFormatter,
        help="a tfgpt adapter run (--lora-rank) -> a tfgpt run with the adapters folded in",
        description="Reads a tfgpt run that trained low-rank adapters (its checkpoint holds\n"
        "the adapters and names their base), folds them into the base's kernels\n"
        "(W + alpha / rank A B) and writes a plain tfgpt run directory (config.json,\n"
        "ckpt-0, the tokenizer).",
    )
    to_peft = commands.add_parser(
        "to-peft", formatter_class=HelpFormatter,
        help="a tfgpt adapter run (--lora-rank) -> PEFT's LoRA adapter layout",
        description="Reads a tfgpt run that trained low-rank adapters and writes them as a\n"
        "PEFT LoRA adapter (adapter_config.json, adapter_model.safetensors) of the\n"
        "transformers checkpoint of its base, which peft.PeftModel.from_pretrained\n"
        "loads onto that checkpoint. A fused projection's adapter becomes one per\n"
        "transformers projection. The model type is --model-type's, else that of\n"
        "--base-model's config.json.",
    )
    to_peft.add_argument("source", metavar="ADAPTER_RUN", help="tfgpt adapter run to read")
    to_peft.add_argument("output", metavar="OUTPUT_DIR", help="PEFT adapter directory to write")
    to_peft.add_argument("--base-model", metavar="NAME_OR_PATH", default="",
                         help="the transformers base the adapters go on (a directory or a hub "
                         "name), written as base_model_name_or_path (default: %(default)r)")
    to_peft.add_argument("--model-type", metavar="TYPE", default=None,
                         help=f"transformers model type of the base: {', '.join(MODEL_TYPES)} "
                         "(default: %(default)s, the model_type of --base-model's config.json)")
    merge.add_argument("source", metavar="ADAPTER_RUN", help="tfgpt adapter run to read")
    merge.add_argument("output", metavar="OUTPUT_DIR", help="tfgpt run directory to write")
    to_tfgpt.add_argument("source", metavar="GPT2_DIR", help="GPT-2 directory to read")
    to_tfgpt.add_argument("output", metavar="OUTPUT_DIR", help="tfgpt run directory to write")
    to_gpt2.add_argument("source", metavar="TFGPT_DIR", help="tfgpt run or GPT-2 directory to read")
    to_gpt2.add_argument("output", metavar="OUTPUT_DIR", help="GPT-2 directory to write")
    return parser.parse_args(argv)


if __name__ == "__main__":
    # `--help` and flag errors are answered here, before TensorFlow loads below.
    parse_args()

# GPT-2's conversion lives in its family's folder; these names are its public entry points.
from tfgpt.models.gpt2.hf_conversion import (  # noqa: E402, F401
    gpt2_config_from_model,
    gpt_config_from_gpt2,
    load_gpt2_checkpoint,
    save_gpt2_adapter,
    save_gpt2_checkpoint,
    special_token_ids,
)
from tfgpt.models.gpt2.hf_conversion import gpt2_weight_map as weight_map  # noqa: E402, F401
from tfgpt.tokenizers import BytePairTokenizer  # noqa: E402


def _require_adapters(source, what):
    """Raises ValueError, in one line, unless `source` is a run that trained adapters."""
    from tfgpt.checkpoint import read_config

    if not (read_config(source).get("train") or {}).get("lora_rank"):
        raise ValueError(f"{source} trained no adapters (no --lora-rank in its config.json): "
                         f"{what}")


def merge(source, output):
    """Writes the adapter run `source` with its adapters folded in as the tfgpt
    run `output`; returns the merged model. Raises ValueError in one line for
    a run that trained no adapters."""
    from pipelines.chat_template import load_chat_template
    from tfgpt import loading

    _require_adapters(source, "nothing to merge; to-tfgpt copies a run as it is")
    model, tokenizer = loading.load_model(source)  # the adapters folded in (adapters.merged)
    # (the chat template its data was prepared with, for tfgpt.generate --chat)
    loading.save_model(output, model, tokenizer, chat_template=load_chat_template(source))
    return model


def to_peft(source, output, base_model="", model_type=None):
    """Writes the adapters of the adapter run `source` as the PEFT LoRA adapter
    `output` of the transformers `model_type` checkpoint of its base
    (`tfgpt.convert_decoders.save_hf_adapter`); `base_model` is written as
    its `base_model_name_or_path` and, a transformers directory, gives the
    model type when `model_type` is None. Returns the adapted model.

    Raises ValueError in one line for a run that trained no adapters, a model
    type that is neither given nor found, or one whose switches the run's
    model lacks.
    """
    from tfgpt import loading
    from tfgpt.convert_decoders import converter, hf_config_of, save_hf_adapter

    _require_adapters(source, "nothing to write; to-gpt2 writes a run's weights")
    source_of_type = None
    if model_type is None:
        source_of_type = os.path.join(base_model, "config.json")
        if not (base_model and os.path.isfile(source_of_type)):
            raise ValueError("to-peft needs the base's transformers model type: give "
                             f"--model-type, or --base-model a transformers directory. Received: "
                             f"base_model={base_model!r}")
        with open(source_of_type) as file:
            model_type = json.load(file).get("model_type")
    converter(model_type, source_of_type)  # one the families write
    model, _ = loading.load_model(source, merge_adapters=False)
    hf_config_of(model.config, model_type)  # its switches, or the one the type lacks
    save_hf_adapter(model, output, model_type, base_model)
    return model


def _run(args):
    """Runs the subcommand `args.command`; returns the line it reports."""
    if args.command == "merge":
        model = merge(args.source, args.output)
        return f"wrote {args.output} ({model.count_params():,} parameters, adapters merged)"
    if args.command == "to-peft":
        from tfgpt.models.adapters import adapter_variables

        model = to_peft(args.source, args.output, args.base_model, args.model_type)
        count = sum(int(variable.numpy().size) for variable in adapter_variables(model))
        return f"wrote {args.output} ({count:,} adapter parameters, PEFT's LoRA layout)"
    from tfgpt import loading

    if args.command == "to-tfgpt":  # any decoder tfgpt.loading reads
        from pipelines.chat_template import load_chat_template

        model, tokenizer = loading.load_model(args.source)
        loading.save_model(args.output, model, tokenizer,
                           chat_template=load_chat_template(args.source))
    else:
        model, tokenizer = loading.load_model(args.source)
        if tokenizer is not None and not isinstance(tokenizer, BytePairTokenizer):
            print(
                "note: the tokenizer is not GPT-2's byte-level BPE; only the "
                "weights and config.json (with its bos and eos ids) are written",
                file=sys.stderr,
            )
        save_gpt2_checkpoint(model, args.output, tokenizer)
    return f"wrote {args.output} ({model.count_params():,} parameters)"


def main(argv=None):
    args = parse_args(argv)
    try:
        print(_run(args))
    except (ValueError, FileNotFoundError) as error:  # one line, as argparse's own errors
        print(f"python -m tfgpt.convert {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
