"""Training tokens/s of a Llama-shaped tfgpt GPT against transformers' LlamaForCausalLM.

Both train the same shape (`--preset`, default `llama-demo`: 4 layers,
hidden 192, 4 query heads sharing 2 key-value heads, SwiGLU 512) on the
same random batches, float32, AdamW, in this process's threads: tfgpt's
`TrainStep` (graph mode, the fused kernels where they apply) and
transformers' model in torch eager mode with `attn_implementation="sdpa"`.
Each side runs `--warmup` untimed steps, then `--steps` timed ones; the
figures are whole steps (forward, backward, update) per second of wall
time. A bench, not a test: it prints, it asserts nothing.

    python -m bench.llama_speed --batch-size 8 --sequence-length 128 --steps 20
"""

import argparse
import dataclasses
import os
import time


def _tfgpt_rate(config, batches, warmup):
    import keras

    from tfgpt.config.training import TrainConfig
    from tfgpt.models.gpt import GPT
    from tfgpt.optim.optimizers import make_optimizer
    from tfgpt.parallel import LocalDistribution
    from tfgpt.training.train_step import TrainStep

    keras.utils.set_random_seed(0)
    model = GPT(**dataclasses.asdict(config))
    optimizer = make_optimizer(TrainConfig(data="-", warmup_steps=0), 1, steps=len(batches))
    optimizer.build(model.trainable_variables)
    step = TrainStep(model, optimizer, LocalDistribution())
    for batch in batches[:warmup]:
        step(batch)
    begin = time.perf_counter()
    for batch in batches[warmup:]:
        loss = step(batch)["loss"]
    float(loss)  # the last step done
    return (len(batches) - warmup) / (time.perf_counter() - begin), model.count_params()


def _torch_rate(config, batches, warmup):
    import torch
    import transformers

    from tfgpt.convert_decoders import hf_config_of

    fields = hf_config_of(config, "llama")
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.1)
    model.train()

    def step(batch):
        inputs, targets = (torch.from_numpy(part).long() for part in batch)
        logits = model(inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    for batch in batches[:warmup]:
        step(batch)
    begin = time.perf_counter()
    for batch in batches[warmup:]:
        loss = step(batch)
    loss.item()  # the last step done
    return (len(batches) - warmup) / (time.perf_counter() - begin), model.num_parameters()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-demo")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)

    import numpy as np

    from tfgpt.config import GPTConfig

    config = GPTConfig.from_preset(args.preset, max_sequence_length=args.sequence_length)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(args.warmup + args.steps):
        tokens = rng.integers(0, config.vocabulary_size,
                              (args.batch_size, args.sequence_length + 1))
        batches.append((tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)))
    tokens_per_step = args.batch_size * args.sequence_length
    rates = {"tfgpt (TensorFlow graph)": _tfgpt_rate(config, batches, args.warmup),
             "transformers LlamaForCausalLM (torch eager)": _torch_rate(config, batches,
                                                                        args.warmup)}
    from tfgpt.observe.flops import processor_name

    cpu = processor_name()
    print(f"{args.preset}: batch {args.batch_size} x {args.sequence_length} tokens, "
          f"{args.steps} timed steps after {args.warmup}, float32, {os.cpu_count()} CPU(s): {cpu}")
    for name, (steps_per_second, parameters) in rates.items():
        print(f"  {name}: {steps_per_second * tokens_per_step:,.0f} tokens/s "
              f"({parameters:,} parameters)")
    (ours, _), (theirs, _) = rates.values()
    print(f"  tfgpt / transformers: {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
