"""``scripts/sample.py``: text from a language-model checkpoint (the tokenizer comes from its data config)."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from moekit.checkpoint import load_task
from moekit.models.generate import check_generation, generate, tokens_run
from moekit.tasks import LanguageModel

from .common import datamodule_for, inference_device

__all__ = ["sample"]


def sample(cfg: DictConfig) -> list[str]:
    """Generate ``num_samples`` continuations of ``prompt`` with a language-model checkpoint (the
    tokenizer comes from the checkpoint's data config). Prints and returns the texts; a single sample is
    printed as it is generated (``stream``)."""
    _check_settings(cfg)
    check_generation(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)  # before the checkpoint loads
    module = load_task(cfg.ckpt_path)
    if not isinstance(module, LanguageModel):
        raise ValueError(
            f"ckpt_path={cfg.ckpt_path!r} holds a model of type {type(module).__name__}, not a language model; "
            "sample from a checkpoint of a language-model experiment (e.g. experiment=moe_transformer_lm)"
        )
    tokenizer = datamodule_for(cfg, module).tokenizer
    prompt_ids = tokenizer.encode(cfg.prompt)
    if not prompt_ids:
        if not cfg.prompt:
            raise ValueError(f"prompt={cfg.prompt!r} encodes to no tokens; give a prompt of at least one character")
        raise ValueError(  # a tokenizer without an unknown token drops the characters it does not know
            f"prompt={cfg.prompt!r} encodes to no tokens: tokenizer {tokenizer.name!r} drops every character of it "
            "(characters outside its vocabulary, which it has no unknown token for, or whitespace it splits on); give "
            "a prompt of characters the tokenizer knows"
        )
    max_seq_len = getattr(module.net, "max_seq_len", None)
    if not cfg.slide and max_seq_len is not None and tokens_run(len(prompt_ids), cfg.max_new_tokens) > max_seq_len:
        fits = len(prompt_ids) <= max_seq_len  # else no max_new_tokens helps
        lower = f"lower max_new_tokens to {max_seq_len + 1 - len(prompt_ids)}, " if fits else ""
        raise ValueError(
            f"the prompt ({len(prompt_ids)} tokens) + max_new_tokens={cfg.max_new_tokens} exceed the model's "
            f"max_seq_len={max_seq_len}; {lower}shorten the prompt, or set slide=true (a sliding window over the last "
            "max_seq_len tokens)"
        )
    device = inference_device(cfg.device)
    net = module.net.to(device)
    prompt = torch.tensor([prompt_ids] * cfg.num_samples, device=device)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    stream = _Stream(tokenizer, prompt_ids) if cfg.stream and cfg.num_samples == 1 else None
    tokens = generate(
        net,
        prompt,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        use_cache=cfg.use_cache,
        generator=generator,
        on_token=stream,
        slide=cfg.slide,
        vocab_limit=tokenizer.vocab_size,  # a padded embedding's extra rows decode to nothing
    )
    texts = [tokenizer.decode(row.tolist()) for row in tokens.cpu()]
    if stream is not None:
        stream.finish(texts[0])
        return texts
    for i, text in enumerate(texts):
        print(f"--- sample {i} ---\n{text}")
    return texts


def _check_settings(cfg: DictConfig) -> None:
    """The settings Hydra may have parsed into another type than the one meant, refused before the checkpoint loads."""
    if cfg.prompt is None:
        raise ValueError("prompt=null; give the text to continue, e.g. 'prompt=\"def \"'")
    if not isinstance(cfg.prompt, str):  # prompt=1984 is an int
        raise ValueError(
            f"prompt={cfg.prompt!r} is not text (Hydra read it as {type(cfg.prompt).__name__}); quote it: "
            f"'prompt=\"{cfg.prompt}\"'"
        )
    if isinstance(cfg.num_samples, bool) or not isinstance(cfg.num_samples, int) or cfg.num_samples < 1:
        raise ValueError(f"num_samples={cfg.num_samples!r} must be an int >= 1")
    for key in ("stream", "use_cache", "slide"):
        if not isinstance(cfg[key], bool):
            raise ValueError(f"{key}={cfg[key]!r} must be true or false")


class _Stream:
    """Prints one sample's text as its tokens come: the prompt, then each step's new characters (a byte that
    starts a multi-byte character waits for the rest of it)."""

    def __init__(self, tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self.printed = tokenizer.decode(self.ids)
        print(f"--- sample 0 ---\n{self.printed}", end="", flush=True)

    def __call__(self, next_token: torch.Tensor) -> None:
        self.ids.append(int(next_token[0]))
        text = self.tokenizer.decode(self.ids)
        if text.startswith(self.printed) and not text.endswith("\ufffd"):
            print(text[len(self.printed) :], end="", flush=True)
            self.printed = text

    def finish(self, text: str) -> None:
        print(text[len(self.printed) :] if text.startswith(self.printed) else f"\n{text}", flush=True)
