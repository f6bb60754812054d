"""Writes the decoder retrieval fixtures (a Qwen3-Embedding-shaped embedder and a
Qwen3-Reranker-shaped reranker) and what sentence-transformers / transformers compute on them.

    python scripts/make_decoder_retrieval_fixtures.py OUT_DIR

OUT_DIR/fixtures/NAME are model directories with seeded random weights, written the way the
published ones are; OUT_DIR/reference/NAME.json hold the float32 outputs.

- tiny-qwen3-embedding: a Qwen3 decoder saved by sentence-transformers (`Transformer` +
  `Pooling(lasttoken)` + `Normalize`), so the weights are the bare `Qwen3Model`'s (no `model.`
  prefix, no head) and `tie_word_embeddings` is false, as Qwen3-Embedding-4B/8B ship; the
  tokenizer appends `<|endoftext|>` to every text (the token the last-token pooling reads) and
  `config_sentence_transformers.json` names Qwen3-Embedding's `query` prompt. Reference:
  `SentenceTransformer.encode`, with and without `prompt_name="query"`.
- tiny-qwen3-reranker: a `Qwen3ForCausalLM` with Qwen3-Reranker's README heading; reference:
  the model card's scoring (prefix + pair + suffix, `P(yes)` over `{yes, no}` at the last
  position) in float32.

Both use a small byte-level BPE trained here on the texts (the tokenizer is not what is tested:
Qwen's is exercised by the real-model tests), with `yes` and `no` as whole tokens.
"""

import shutil
import sys
from pathlib import Path

import torch
from sentence_transformers import SentenceTransformer, models
from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The encoder fixtures' texts, query and documents, and their JSON writer.
from make_retrieval_fixtures import DOCUMENTS, QUERY, TEXTS, write  # noqa: E402

QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
# Qwen3-Reranker's model card.
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
          "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
CUSTOM_INSTRUCTION = "Find the sentence about cats"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def seeded(model, seed, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return model


def train_tokenizer(append_eos):
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = TEXTS + DOCUMENTS + [QUERY, QUERY_PROMPT, PREFIX, SUFFIX, INSTRUCTION] + ["yes\nno\nyes no\n"] * 50
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 4, trainer)
    for word in ("yes", "no"):
        assert tok.token_to_id(word) is not None, word
    if append_eos:
        eos = tok.token_to_id("<|endoftext|>")
        tok.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
                                                           special_tokens=[("<|endoftext|>", eos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   padding_side="left", model_max_length=256)


def qwen3_config(vocab, tie):
    return Qwen3Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=256,
                       tie_word_embeddings=tie, rms_norm_eps=1e-6, rope_theta=1e6)


def embedder(out, name, seed):
    d = out / "fixtures" / name
    if d.exists():
        shutil.rmtree(d)
    fast = train_tokenizer(append_eos=True)
    lm = seeded(Qwen3ForCausalLM(qwen3_config(len(fast), tie=False)), seed).eval()
    tmp = out / "tmp-qwen3"
    lm.save_pretrained(tmp)
    fast.save_pretrained(tmp)
    word = models.Transformer(str(tmp), max_seq_length=256)
    pool = models.Pooling(32, pooling_mode="lasttoken")
    st = SentenceTransformer(modules=[word, pool, models.Normalize()], device="cpu",
                             prompts={"query": QUERY_PROMPT, "document": ""})
    st.save(str(d))
    shutil.rmtree(tmp)
    st = SentenceTransformer(str(d), device="cpu", model_kwargs={"dtype": torch.float32})
    docs = st.encode(DOCUMENTS + TEXTS, convert_to_numpy=True, normalize_embeddings=False)
    queries = st.encode([QUERY], prompt_name="query", convert_to_numpy=True, normalize_embeddings=False)
    write(out / "reference" / f"{name}.json",
          {"texts": DOCUMENTS + TEXTS, "input_ids": [st.tokenizer(t)["input_ids"] for t in DOCUMENTS + TEXTS],
           "embeddings": docs.tolist(), "query": QUERY, "query_prompt_name": "query",
           "query_input_ids": st.tokenizer(QUERY_PROMPT + QUERY)["input_ids"], "query_embedding": queries[0].tolist()})


def reranker(out, name, seed):
    d = out / "fixtures" / name
    if d.exists():
        shutil.rmtree(d)
    fast = train_tokenizer(append_eos=False)
    model = seeded(Qwen3ForCausalLM(qwen3_config(len(fast), tie=True)), seed, scale=0.5).eval()
    model.save_pretrained(d)
    fast.save_pretrained(d)
    (d / "README.md").write_text("---\nlicense: apache-2.0\n---\n# Qwen3-Reranker\n\nA tiny random stand-in "
                                 "for Kylin's tests, written by scripts/make_decoder_retrieval_fixtures.py.\n")
    yes, no = fast.convert_tokens_to_ids("yes"), fast.convert_tokens_to_ids("no")
    prefix = fast.encode(PREFIX, add_special_tokens=False)
    suffix = fast.encode(SUFFIX, add_special_tokens=False)
    def score(instruction):
        ids, scores, logits = [], [], []
        for doc in DOCUMENTS:
            pair = f"<Instruct>: {instruction}\n<Query>: {QUERY}\n<Document>: {doc}"
            full = prefix + fast(pair)["input_ids"] + suffix
            with torch.no_grad():
                last = model(torch.tensor([full])).logits[0, -1].float()
            two = torch.stack([last[no], last[yes]])
            ids.append(full)
            logits.append([float(last[no]), float(last[yes])])
            scores.append(float(torch.log_softmax(two, dim=0)[1].exp()))
        return ids, scores, logits

    ids, scores, logits = score(INSTRUCTION)
    _, custom_scores, _ = score(CUSTOM_INSTRUCTION)
    write(out / "reference" / f"{name}.json",
          {"query": QUERY, "documents": DOCUMENTS, "instruction": INSTRUCTION, "input_ids": ids,
           "no_yes_logits": logits, "scores": scores, "yes_id": yes, "no_id": no,
           "custom_instruction": CUSTOM_INSTRUCTION, "custom_scores": custom_scores})


def main():
    out = Path(sys.argv[1])
    (out / "fixtures").mkdir(parents=True, exist_ok=True)
    (out / "reference").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    embedder(out, "tiny-qwen3-embedding", 11)
    reranker(out, "tiny-qwen3-reranker", 12)


if __name__ == "__main__":
    main()
