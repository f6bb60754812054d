"""Writes transformers' own prompt log-probabilities for the echo tests.

For each model directory given, the prompt below is tokenized by the model's tokenizer (with its
special tokens), run through the model in float32 (eager attention), and every position's
`log_softmax` is kept for the next prompt token plus the five best ids: what
`/v1/completions` with `echo: true, logprobs: 5` must report.

    python scripts/make_prompt_logprobs_reference.py OUT_DIR MODEL_DIR...
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = (
    "The quick brown fox jumps over the lazy dog. Evaluation harnesses score a continuation by the sum "
    "of its tokens' log-probabilities under the model, so every position of the prompt must match the "
    "reference implementation, not only the last one."
)


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for model_dir in sys.argv[2:]:
        name = Path(model_dir).name
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        model.eval()
        ids = tokenizer(PROMPT)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        positions = []
        for p in range(len(ids) - 1):
            top = torch.topk(logprobs[p], 5)
            positions.append(
                {
                    "token": ids[p + 1],
                    "logprob": logprobs[p, ids[p + 1]].item(),
                    "top": [[int(i), float(v)] for v, i in zip(top.values, top.indices)],
                }
            )
        (out / f"{name}.json").write_text(
            json.dumps({"model": name, "prompt": PROMPT, "input_ids": ids, "positions": positions}, indent=1)
        )
        print(f"{name}: {len(ids)} tokens")


if __name__ == "__main__":
    main()
