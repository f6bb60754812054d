"""Kylin from Python: Hugging Face models on the CPU behind vLLM's offline API.

    import kylin

    llm = kylin.LLM("~/models/SmolLM2-135M-Instruct", threads=2)
    params = kylin.SamplingParams(temperature=0, max_tokens=32)
    for out in llm.generate(["The capital of France is"], params):
        print(out.outputs[0].text)
    print(llm.chat([{"role": "user", "content": "Hi!"}], params)[0].outputs[0].text)
    for piece in llm.stream("Once upon a time", params):
        print(piece.text, end="", flush=True)

    embedder = kylin.LLM("~/models/all-MiniLM-L6-v2")
    vectors = [o.outputs.embedding for o in embedder.embed(["a text", "another"])]

The engine runs in Rust (the continuous-batching engine for decoders, the encoder engine for
embedding models and rerankers); the GIL is released while it runs. Errors are
`kylin.KylinError`, whose `code` is Kylin's stable error code (`INPUT_INVALID`,
`CONTEXT_OVERFLOW`, ...).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

from . import _kylin

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "StreamOutput",
    "EmbeddingRequestOutput",
    "EmbeddingOutput",
    "KylinError",
]

KylinError = _kylin.KylinError
KylinError.code = property(lambda self: self.args[1] if len(self.args) > 1 else None)
KylinError.__str__ = lambda self: str(self.args[0]) if self.args else ""


@dataclass
class SamplingParams:
    """vLLM's sampling parameters. Fields left as None take the model's
    `generation_config.json` values (as `kylin run` and `kylin serve` do); greedy when it does
    not ask to sample. `max_tokens` defaults to 16, as vLLM's."""

    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    # At most this many speculative proposals per step for this request, within the engine's
    # `speculative_tokens` (0 turns speculation off for it; more is a KylinError INPUT_INVALID).
    speculative_tokens: Optional[int] = None

    def _request(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    cumulative_logprob: Optional[float]
    logprobs: Optional[list]
    finish_reason: Optional[str] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    prompt_logprobs: Optional[list]
    outputs: list
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class StreamOutput:
    """One piece of a streamed generation: the new text and token ids of choice `index`."""

    index: int
    text: str
    token_ids: list
    finish_reason: Optional[str] = None


@dataclass
class EmbeddingOutput:
    embedding: list


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list
    outputs: EmbeddingOutput
    finished: bool = True


def _logprob_entry(lp: dict) -> dict:
    """vLLM's per-position log-probabilities: token id -> logprob (the chosen one included)."""
    entry = {int(i): float(p) for i, p in lp["top"]}
    entry.setdefault(int(lp["id"]), float(lp["logprob"]))
    return entry


def _images_of(conversation):
    """A conversation's OpenAI `image_url` parts as the chat template reads them (`{"type":
    "image"}`), and the image files' bytes in order: a base64 `data:` URL, a `file://` URL or
    a local path (nothing is fetched from the network)."""
    import base64
    out, images = [], []
    for message in conversation:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise KylinError("an image_url part needs `image_url.url`", "INPUT_INVALID")
                if url.startswith("data:"):
                    header, _, data = url.partition(",")
                    if ";base64" not in header:
                        raise KylinError("a data: image URL must be base64", "INPUT_INVALID")
                    images.append(base64.b64decode(data))
                elif url.startswith(("http://", "https://")):
                    raise KylinError("Kylin fetches nothing from the network: give a data: URL or a local path",
                                     "INPUT_INVALID")
                else:
                    path = url[len("file://"):] if url.startswith("file://") else url
                    with open(path, "rb") as f:
                        images.append(f.read())
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images


class LLM:
    """A model on Kylin's engine, as vLLM's `LLM` reads.

    Engine options: `threads` (default: physical cores), `ctx_size`, `max_seqs`,
    `max_batch_tokens`, `kv_memory` (bytes), `precision` (`"f32"`, the default, exact against
    transformers' float32; `"bf16"`; `"auto"`), `task` (`"auto"`, the default: what the
    directory's files say; `"generate"`, `"embed"`, `"rerank"`, as `kylin serve --task`),
    `speculative_tokens` (n-gram speculative decoding: up to that many proposals per sequence
    and step; the outputs are the same), `speculative_step_tokens` (the most tokens a step
    computes for decoding sequences and their proposals, default 32), `draft_model` (a
    directory whose model, with the same tokenizer, proposes instead; `speculative_tokens`
    then defaults to 4) and `mtp` (True: the checkpoint's own multi-token-prediction head
    proposes, as Qwen3.5 and Qwen3-Next ship it; `speculative_tokens` then defaults to 2)."""

    def __init__(self, model: str, **engine_options: Any):
        known = {"threads", "ctx_size", "max_seqs", "max_batch_tokens", "kv_memory", "precision", "task",
                 "speculative_tokens", "speculative_step_tokens", "draft_model", "mtp"}
        unknown = set(engine_options) - known
        if unknown:
            raise KylinError(f"unknown engine options: {', '.join(sorted(unknown))}", "INPUT_INVALID")
        self.model = os.path.expanduser(str(model))
        if engine_options.get("draft_model") is not None:
            engine_options["draft_model"] = os.path.expanduser(str(engine_options["draft_model"]))
        self._engine = _kylin.Engine(self.model, json.dumps(engine_options))
        self.info = json.loads(self._engine.info())

    # -- generation ---------------------------------------------------------------------------

    def _submit(self, prompt, params: SamplingParams, add_special_tokens=True, images=()) -> int:
        request = params._request()
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                request["prompt_token_ids"] = list(prompt["prompt_token_ids"])
            else:
                request["prompt"] = prompt["prompt"]
        elif isinstance(prompt, str):
            request["prompt"] = prompt
        else:
            request["prompt_token_ids"] = list(prompt)
        request["add_special_tokens"] = add_special_tokens
        return self._engine.submit(json.dumps(request), list(images))

    def _collect(self, rid: int, prompt_text, n: int) -> RequestOutput:
        texts = [""] * n
        ids = [[] for _ in range(n)]
        logprobs = [[] for _ in range(n)]
        cumulative = [0.0] * n
        reasons = [None] * n
        prompt_lps = None
        cached = 0
        prompt_ids = []
        while True:
            polled = json.loads(self._engine.poll(rid))
            prompt_ids = polled["prompt_token_ids"] or prompt_ids
            for e in polled["events"]:
                i = e["index"]
                if e["kind"] == "token":
                    texts[i] += e["text"]
                    ids[i].append(e["id"])
                    if e["logprob"] is not None:
                        logprobs[i].append(_logprob_entry(e["logprob"]))
                        cumulative[i] += e["logprob"]["logprob"]
                elif e["kind"] == "prompt_logprobs":
                    if prompt_lps is None:
                        prompt_lps = [None]
                    prompt_lps.extend(_logprob_entry(lp) for lp in e["logprobs"])
                elif e["kind"] == "finished":
                    texts[i] += e["text"]
                    reasons[i] = e["finish_reason"]
                    cached = max(cached, e["cached_tokens"])
            if polled["done"]:
                break
        outputs = [
            CompletionOutput(index=i, text=texts[i], token_ids=ids[i],
                             cumulative_logprob=cumulative[i] if logprobs[i] else None,
                             logprobs=logprobs[i] or None, finish_reason=reasons[i])
            for i in range(n)
        ]
        return RequestOutput(request_id=str(rid), prompt=prompt_text, prompt_token_ids=prompt_ids,
                             prompt_logprobs=prompt_lps, outputs=outputs, num_cached_tokens=cached)

    def generate(self, prompts, sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
                 use_tqdm: bool = False) -> list:
        """Generates for every prompt (a string, token ids, or `{"prompt"}` /
        `{"prompt_token_ids"}`) at once on the batching engine; one `RequestOutput` each, in
        order."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        per_prompt = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise KylinError("give one SamplingParams or one per prompt", "INPUT_INVALID")
        ids = [self._submit(p, sp) for p, sp in zip(prompts, per_prompt)]
        texts = [p if isinstance(p, str) else (p.get("prompt") if isinstance(p, dict) else None) for p in prompts]
        return [self._collect(rid, t, sp.n) for rid, t, sp in zip(ids, texts, per_prompt)]

    def chat(self, messages, sampling_params: Optional[SamplingParams] = None, *,
             add_generation_prompt: bool = True, chat_template_kwargs: Optional[dict] = None,
             use_tqdm: bool = False) -> list:
        """Renders a conversation (or a list of conversations) through the model's chat
        template and generates, as vLLM's `LLM.chat`."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        params = sampling_params if sampling_params is not None else SamplingParams()
        kwargs = json.dumps(chat_template_kwargs or {})
        with_images = [_images_of(c) for c in conversations]
        rendered = [self._engine.render_chat(json.dumps(c), add_generation_prompt, kwargs) for c, _ in with_images]
        ids = [self._submit(text, params, add_special_tokens=False, images=images)
               for text, (_, images) in zip(rendered, with_images)]
        return [self._collect(rid, text, params.n) for rid, text in zip(ids, rendered)]

    def stream(self, prompt, sampling_params: Optional[SamplingParams] = None) -> Iterator[StreamOutput]:
        """Generates for one prompt and yields its text as it is produced (other requests of
        the same `LLM` keep running in the same batches)."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        rid = self._submit(prompt, params)
        finished = False
        try:
            while True:
                polled = json.loads(self._engine.poll(rid))
                for e in polled["events"]:
                    if e["kind"] == "token":
                        yield StreamOutput(index=e["index"], text=e["text"], token_ids=[e["id"]])
                    elif e["kind"] == "finished":
                        yield StreamOutput(index=e["index"], text=e["text"], token_ids=[],
                                           finish_reason=e["finish_reason"])
                if polled["done"]:
                    finished = True
                    return
        finally:
            if not finished:
                self._engine.cancel(rid)

    # -- text and retrieval --------------------------------------------------------------------

    def get_tokenizer(self):
        return _Tokenizer(self._engine)

    def embed(self, prompts, *, prompt_name: Optional[str] = None, dimensions: Optional[int] = None,
              use_tqdm: bool = False) -> list:
        """Embeddings of texts (or token ids) with an embedding model, pooled and normalised as
        its sentence-transformers files say; `dimensions` keeps the first N (normalised again
        for a normalised model); `prompt_name` prefixes the model's named prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        emb = self.info.get("embedding")
        if emb is None:
            raise KylinError("this model does not make embeddings", "INPUT_INVALID")
        if prompt_name is not None:
            prefix = emb["prompts"].get(prompt_name)
            if prefix is None:
                raise KylinError(f"the model has no prompt `{prompt_name}`", "INPUT_INVALID")
            prompts = [prefix + p if isinstance(p, str) else p for p in prompts]
        vectors = json.loads(self._engine.embed(json.dumps([p if isinstance(p, str) else list(p) for p in prompts])))
        if dimensions is not None:
            if not 0 < dimensions <= emb["dimension"]:
                raise KylinError(f"dimensions must be between 1 and {emb['dimension']}", "INPUT_INVALID")
            cut = []
            for v in vectors:
                v = v[:dimensions]
                if emb["normalized"]:
                    norm = max(sum(x * x for x in v) ** 0.5, 1e-12)
                    v = [x / norm for x in v]
                cut.append(v)
            vectors = cut
        ids = [self._engine.tokenize(p, True) if isinstance(p, str) else list(p) for p in prompts]
        return [EmbeddingRequestOutput(request_id=str(i), prompt_token_ids=t, outputs=EmbeddingOutput(v))
                for i, (t, v) in enumerate(zip(ids, vectors))]

    def score(self, query: str, documents: Sequence[str], instruction: Optional[str] = None) -> list:
        """Relevance of each document to `query` with a reranker (a cross-encoder, or a yes/no
        decoder reranker such as Qwen3-Reranker)."""
        return list(self._engine.rerank(query, list(documents), instruction))


class _Tokenizer:
    def __init__(self, engine):
        self._engine = engine

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        return self._engine.tokenize(text, add_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._engine.detokenize(list(ids), skip_special_tokens)
