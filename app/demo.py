"""The OELM Lab web demo: GPT-Base, OELM-NoFreeze and OELM-Freeze side by side.

Start-up loads each group's model once, on the GPU when there is one: from a checkpoint
(``oelm_core.checkpoint.load_model``, weights-only), a run folder, or a folder that
``oelm_core.export`` wrote (safetensors, or transformers' GPT-2). The page then offers

* a card per model (shape, parameter counts, validation perplexity and step of the checkpoint),
* side-by-side generation: one prompt, seed and sampling setting sent to every model, the texts
  streaming into one column each, round-robin, token by token,
* attention maps of a chosen model, layer and head (or the mean over heads) over the prompt and
  the generated text (the token ids it sampled, not the text encoded again), the same map of
  every model side by side, and per-head summaries
  (attention entropy, mean attention distance) to compare frozen with trainable Q/K.

A checkpoint that is missing, unreadable or of another group (its Q/K initialisation, freezing,
attention or POET setting is not the group's) does not stop the server: that model's column
says what went wrong and how to fix it, and the models that loaded are served. Where none
loaded, or --device names a device this machine lacks, the page says why instead of the panels.

Every value the page or the API sends reaches the handlers as it was sent (the events skip
Gradio's preprocessing, whose range checks answered first and named no setting): the handlers
check each one and name the setting, the value and the range.
"""

from __future__ import annotations

import math
from typing import Iterator

import gradio as gr
import torch

from app.lab import (
    MINI_COMMAND,
    MINI_STUDY_OUT,
    Lab,
    LoadedModel,
    SetupError,
    barely_trained,
    cpu_route,
    group_label,
    mini_study_cost,
    refuse,
)
from oelm_core import VARIANTS
from oelm_core.analysis import SAMPLE_TOP_K, attention_maps, summarise_attention, uniform_reference
from oelm_core.analysis.heatmaps import compare_figure, heatmap_figure, summary_figure, token_label
from oelm_core.batches import perplexity
from oelm_core.data import encode_prompt
from oelm_core.fast import stream_tokens
from oelm_core.generate import SamplingConfig, detokenize

# Input ranges: the sliders' bounds, checked by the handlers (the API can send anything, and the
# events skip the components' own checks, which name no setting).
LIMITS = {
    "max_new_tokens": (1, 512),
    "temperature": (0.0, 2.0),
    "top_k": (0, 1000),
    "top_p": (0.01, 1.0),
    "seed": (0, 2**31 - 1),
}
MAX_PROMPT_CHARS = 20_000
DEFAULT_PROMPT = "Once upon a time, there was a little girl named Lily. She"
MEAN_HEAD = "mean"


# --------------------------------------------------------------------------------------------
# Handlers
# --------------------------------------------------------------------------------------------


def _number(name: str, value, integer: bool = False) -> float:
    """``value`` (as sent: any JSON value) as the number setting ``name`` takes, or gr.Error
    naming the setting, the value and LIMITS' range."""
    lo, hi = LIMITS[name]
    if value is None or (isinstance(value, str) and not value.strip()):
        raise refuse(f"{name} is empty: enter a number between {lo} and {hi}")
    try:
        if isinstance(value, bool):  # float(True) is 1.0: a JSON true is no number
            raise TypeError
        x = float(value)
    except (TypeError, ValueError):
        raise refuse(f"{name} must be a number between {lo} and {hi}, got {value!r}") from None
    if not math.isfinite(x) or not lo <= x <= hi:
        raise refuse(f"{name} must be between {lo} and {hi}, got {value}")
    if integer and x != int(x):
        raise refuse(f"{name} must be a whole number between {lo} and {hi}, got {value}")
    return int(x) if integer else x


def sampling_config(max_new_tokens, temperature, top_k, top_p, seed) -> SamplingConfig:
    """The sampling settings, each checked against its range with a message naming it."""
    return SamplingConfig(
        max_new_tokens=_number("max_new_tokens", max_new_tokens, integer=True),
        temperature=_number("temperature", temperature),
        top_k=_number("top_k", top_k, integer=True),
        top_p=_number("top_p", top_p),
        seed=_number("seed", seed, integer=True),
    ).validate()


# glibc's mallopt parameter (malloc.h) for the number of heaps ("arenas") threads allocate from.
M_ARENA_MAX = -8
SERVER_ARENAS = 2


def _glibc():
    """The C library when it is glibc (its malloc_trim and mallopt), else None (macOS, musl,
    Windows: other allocators, other switches)."""
    import ctypes
    import os

    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return None
        return ctypes.CDLL(None)
    except (AttributeError, ValueError, OSError):
        return None


def bound_server_memory() -> bool:
    """Let the server's threads share SERVER_ARENAS heaps: glibc gives each thread that
    allocates a heap of its own, up to 8 per core, and keeps in each what the largest request
    it served left there. Gradio serves requests from a pool of up to 40 threads, so the RSS
    climbed with the core count (0.73 -> 1.4 GB over 150 requests on a larger machine). On 2
    cores, smoke models, generation and attention alternating: 0.53 GB at the start, 0.81 GB
    from the 80th request on, 0.83 GB idle; with two heaps and ``return_freed_memory`` after
    each request, 0.65-0.72 GB over 240 requests and idle. Call before the server starts its
    threads. False, changing nothing, where the C library is not glibc."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(M_ARENA_MAX, SERVER_ARENAS))


def return_freed_memory() -> None:
    """Give the pages of the blocks a request freed back to the system (glibc's malloc_trim),
    so that an idle server holds what its models need, not what its last requests did."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class Demo:
    """The page's handlers, bound to one Lab (kept apart from the layout so tests call them)."""

    def __init__(self, lab: Lab):
        from oelm_core.data import get_tokenizer

        self.lab = lab
        self.enc = get_tokenizer() if lab.models else None
        self.context = min((m.cfg.block_size for m in lab.models), default=0)

    # ---- prompt -------------------------------------------------------------------------
    def check_prompt(self, prompt) -> list[int]:
        if prompt is not None and not isinstance(prompt, str):
            raise refuse(f"prompt must be text, got {type(prompt).__name__} {prompt!r}")
        if prompt is None or not prompt.strip():
            raise refuse(f"The prompt is empty: type the beginning of a story, e.g. \u201c{DEFAULT_PROMPT}\u201d")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise refuse(
                f"The prompt is {len(prompt):,} characters long; the models read at most "
                f"{self.context} tokens, so shorten it"
            )
        ids = encode_prompt(prompt)  # <|endoftext|> typed is the end-of-text token, as in GPT-2's tokenizer
        if len(ids) >= self.context:
            raise refuse(
                f"The prompt is {len(ids)} tokens long, but the models' context holds "
                f"{self.context} tokens: shorten it to fewer than {self.context} tokens "
                f"(the generated text needs room too)"
            )
        return ids

    # ---- generation ---------------------------------------------------------------------
    def generate(self, prompt, max_new_tokens, temperature, top_k, top_p, seed) -> Iterator[tuple]:
        """Stream every model's continuation of ``prompt`` together: after each round (one new
        piece from every model still going) yield the texts so far, one per model, and then what
        ``attention`` needs to map the tokens the models read: {'prompt': prompt, 'runs':
        {group: {'text': text so far, 'ids': prompt and sampled ids}}}."""
        ids = self.check_prompt(prompt)
        base = sampling_config(max_new_tokens, temperature, top_k, top_p, seed)
        if len(ids) + base.max_new_tokens > self.context:
            gr.Warning(
                f"Prompt ({len(ids)} tokens) plus {base.max_new_tokens} new tokens exceed the "
                f"context of {self.context}: the oldest tokens slide out of the window, and the "
                f"attention maps show the last {self.context} tokens."
            )
        sampled: list[list[int]] = [[] for _ in self.lab.models]

        def recorded(i: int, m: LoadedModel) -> Iterator[int]:
            for token in stream_tokens(m.model, ids, SamplingConfig(**vars(base))):
                sampled[i].append(token)
                yield token

        streams = [detokenize(recorded(i, m), self.enc) for i, m in enumerate(self.lab.models)]
        texts = [""] * len(streams)
        active = list(range(len(streams)))

        def update() -> tuple:
            # A fresh record per update: a stopped generation leaves the texts shown so far.
            runs = {m.group: {"text": texts[i], "ids": ids + sampled[i]} for i, m in enumerate(self.lab.models)}
            return (*texts, {"prompt": prompt, "runs": runs})

        try:
            yield update()
            while active:
                for i in list(active):
                    try:
                        texts[i] += next(streams[i])
                    except StopIteration:
                        active.remove(i)
                yield update()
        finally:  # also when Stop cancels it
            return_freed_memory()

    # ---- attention ----------------------------------------------------------------------
    def _tokens(self, prompt, continuation, generated, group: str) -> list[int]:
        """The ids the model read for ``continuation``: the sampled ones where it is the text
        ``generate`` gave for ``prompt`` (encoding the text again can merge its bytes into other
        tokens than were sampled, e.g. ' a' 'per' 'ote' for ' ape' 'rote'); else, for text from
        elsewhere (an API caller's), the text encoded."""
        self.check_prompt(prompt)
        generated = generated or {}
        run = generated.get("runs", {}).get(group) if generated.get("prompt") == prompt else None
        if run is not None and run["text"] == (continuation or ""):
            ids = run["ids"]
        else:
            ids = encode_prompt(str(prompt) + str(continuation or ""))
        return ids[-self.context :]

    def _head_index(self, head, model: LoadedModel) -> int | None:
        if head in (None, "", MEAN_HEAD):
            return None
        try:
            if isinstance(head, bool) or (isinstance(head, float) and not head.is_integer()):
                raise TypeError
            h = int(head)
        except (TypeError, ValueError):
            raise refuse(
                f"head must be '{MEAN_HEAD}' or a head number 0..{model.cfg.n_head - 1}, got {head!r}"
            ) from None
        if not 0 <= h < model.cfg.n_head:
            raise refuse(f"{model.label} has heads 0..{model.cfg.n_head - 1}; head {h} does not exist")
        return h

    def attention(self, prompt, model_group, layer, head, generated, *continuations):
        """Attention of the chosen model over prompt + that model's generated text, as the token
        ids it sampled where ``generated`` (from ``generate``) holds them for that text.

        Returns (heatmap, the models side by side, per-head summary figure, summary rows, details)
        where details = {'model', 'layer', 'head', 'n_tokens', 'shape', 'tokens'}.
        """
        chosen = self.lab.by_group(model_group)
        index = self.lab.models.index(chosen)
        continuation = continuations[index] if index < len(continuations) else ""
        try:
            if isinstance(layer, bool):
                raise TypeError
            layer_f = float(layer)
        except (TypeError, ValueError):
            raise refuse(f"layer must be a layer number 0..{chosen.cfg.n_layer - 1}, got {layer!r}") from None
        if not (math.isfinite(layer_f) and layer_f == int(layer_f) and 0 <= layer_f < chosen.cfg.n_layer):
            raise refuse(f"{chosen.label} has layers 0..{chosen.cfg.n_layer - 1}; layer {layer} does not exist")
        layer_i = int(layer_f)
        head_i = self._head_index(head, chosen)
        ids = self._tokens(prompt, continuation, generated, chosen.group)
        labels = [token_label(self.enc.decode([i])) for i in ids]
        head_name = "mean over heads" if head_i is None else f"head {head_i}"

        maps = {m.group: attention_maps(m.model, ids)[1] for m in self.lab.models}

        def pick(m: LoadedModel):
            layers = maps[m.group]
            if layer_i >= len(layers):
                return None, f"{m.label} has only {len(layers)} layers"
            att = layers[layer_i]
            if head_i is None:
                return att.mean(0).numpy(), ""
            if head_i >= att.size(0):
                return None, f"{m.label} has only {att.size(0)} heads"
            return att[head_i].numpy(), ""

        matrix, _ = pick(chosen)
        heat = heatmap_figure(matrix, labels, f"{chosen.label}: layer {layer_i}, {head_name} ({len(ids)} tokens)")
        panels = []
        for m in self.lab.models:
            mat, msg = pick(m)
            panels.append((f"{m.label} ({self._qk_state(m, layer_i)} Q/K)", mat, msg))
        compare = compare_figure(
            panels,
            labels,
            f"Layer {layer_i}, {head_name}: the same {len(ids)} tokens (text of {chosen.label}) through every model",
        )

        rows, uniform = self.summary_rows(maps, len(ids))
        summary = summary_figure(rows, uniform, [m.label for m in self.lab.models])
        table = [
            [r["model"], r["layer"], r["head"], r["qk"], round(r["entropy"], 4), round(r["distance"], 3)] for r in rows
        ]
        details = {
            "model": chosen.group,
            "layer": layer_i,
            "head": head_name,
            "n_tokens": len(ids),
            "shape": list(matrix.shape),
            "tokens": labels,
        }
        maps.clear()  # the attention maps go before the heap is trimmed
        return_freed_memory()
        return heat, compare, summary, table, details

    @staticmethod
    def _qk_state(m: LoadedModel, layer: int) -> str:
        return "frozen" if layer in m.cfg.frozen_layers() else "trainable"

    def summary_rows(self, maps: dict[str, list], n_tokens: int) -> tuple[list[dict], dict[str, float]]:
        """Per-head entropy and mean distance of every model from its maps of one text of
        ``n_tokens`` tokens (group -> attention_maps' list of (n_head, T, T) per layer), with the
        model's label and whether the layer's Q/K are frozen; and the uniform baseline."""
        rows = []
        for m in self.lab.models:
            for r in summarise_attention(maps[m.group]):
                rows.append(
                    {
                        "model": m.label,
                        "layer": r["layer"],
                        "head": r["head"],
                        "qk": self._qk_state(m, r["layer"]),
                        "entropy": r["entropy"],
                        "distance": r["mean_distance"],
                    }
                )
        return rows, uniform_reference(n_tokens)


# --------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------


def _fmt_int(n: int) -> str:
    return f"{n:,}"


def model_card(m: LoadedModel, device: str) -> str:
    cfg, c = m.cfg, m.counts
    ppl = checkpoint_ppl(m.state)
    ppl_s = f"{ppl:.2f}" if ppl is not None else "not recorded"
    step = m.state.get("step")
    frozen_layers = cfg.frozen_layers()
    qk = (
        "frozen in every layer"
        if len(frozen_layers) == cfg.n_layer and cfg.n_layer
        else f"frozen in layers {frozen_layers}"
        if frozen_layers
        else "trainable"
    )
    return (
        f"### {m.label}\n"
        f"`{m.group}` \u2014 {VARIANTS.get(m.group, '').split(':', 1)[-1].strip()}\n\n"
        f"| | |\n|:--|:--|\n"
        f"| shape | {cfg.n_layer} layers \u00b7 d_model {cfg.d_model} \u00b7 {cfg.n_head} heads \u00b7 "
        f"context {cfg.block_size} |\n"
        f"| Q/K init | {cfg.qk_init}, {qk} |\n"
        f"| parameters | {_fmt_int(c['total'])} total |\n"
        f"| trainable | {_fmt_int(c['trainable'])} |\n"
        f"| frozen | {_fmt_int(c['frozen'])} |\n"
        f"| validation perplexity | {ppl_s} |\n"
        f"| step | {step if step is not None else 'not recorded'} |\n\n"
        f"<small>checkpoint `{m.path}` on {device}</small>\n"
    )


def checkpoint_ppl(state: dict) -> float | None:
    """The validation perplexity a checkpoint records, or None."""
    metrics = state.get("metrics") or {}
    ppl, loss = metrics.get("val_ppl"), metrics.get("val_loss")
    if ppl is None and isinstance(loss, (int, float)):
        ppl = perplexity(loss)
    return ppl if isinstance(ppl, (int, float)) else None


def undertrained_notice(lab: Lab) -> str | None:
    """What the top of the page says when the loaded models are smoke-sized or barely trained:
    each one's steps and validation perplexity, and the command that trains models worth
    comparing. None when they all look trained."""
    weak = [m for m in lab.models if barely_trained(m.state.get("step"), checkpoint_ppl(m.state), m.cfg.d_model)]
    if not weak:
        return None

    def figures(m: LoadedModel) -> str:
        step, ppl = m.state.get("step"), checkpoint_ppl(m.state)
        return (
            f"{m.label}: {step if step is not None else 'unknown'} steps, validation perplexity "
            f"{f'{ppl:,.0f}' if ppl is not None else 'not recorded'}, d_model {m.cfg.d_model}"
        )

    head = (
        "**These models are barely trained: expect gibberish.** "
        + "; ".join(figures(m) for m in weak)
        + ". Models trained on TinyStories reach a perplexity near 20. "
    )
    if lab.device == "cpu" and not torch.cuda.is_available():
        return head + cpu_route(mini_study_cost())
    return head + (
        f"To compare models worth comparing, train the mini study on a GPU (about two minutes): "
        f"`{MINI_COMMAND}`, then `python -m app --study {MINI_STUDY_OUT}` (or `make demo`, which "
        f"does both)."
    )


def failed_card(group: str, error: str) -> str:
    """The column of a model whose checkpoint did not load: what went wrong and how to fix it."""
    return (
        f"### {group_label(group)}\n`{group}` \u2014 **not loaded**\n\n{error}\n\n"
        f"**How to fix it:** start the demo again with a working checkpoint for {group}: "
        f"`python -m app --ckpt {group}=PATH`, with `--ckpt GROUP=PATH` for each of the others. "
        f"The other models work meanwhile.\n"
    )


def error_page(lab: Lab) -> str:
    items = "\n".join(f"- {e}" for e in lab.errors)
    return (
        "## The models could not be loaded\n\n"
        f"{items}\n\n"
        "**How to fix it:** train the study (`python -m oelm_core run PLAN`), or start the demo "
        "with existing checkpoints: `python -m app --study runs/<study>` or "
        "`python -m app --ckpt gpt_base=PATH --ckpt oelm_nofreeze=PATH --ckpt oelm_freeze=PATH`, "
        "then reload this page."
    )


CSS = """
#load-error, .model-error { border: 2px solid #d62728; border-radius: 8px; padding: 12px 20px; }
.model-card table { font-size: 0.9em; width: 100%; }
.model-card td:first-child { white-space: nowrap; font-weight: 600; }
.model-card thead { display: none; }
.model-card small code { overflow-wrap: anywhere; }
"""


def build_demo(lab: Lab) -> gr.Blocks:
    """The page for ``lab``: a column per model, where a checkpoint that did not load says why;
    the error page where none loaded."""
    with gr.Blocks(title="OELM Lab", analytics_enabled=False) as demo:
        gr.Markdown(
            "# OELM Lab: orthogonal, frozen attention Q/K side by side\n"
            "GPT-Base trains standard Q/K; OELM-NoFreeze starts Q/K as random orthogonal "
            "matrices and trains them; OELM-Freeze keeps them fixed."
        )
        if not lab.models:
            gr.Markdown(error_page(lab), elem_id="load-error")
            return demo

        handlers = Demo(lab)
        demo.oelm = handlers  # tests and scripts reach the handlers through the Blocks
        gr.Markdown(
            f"Checkpoints from {lab.source or 'the command line'}, on **{lab.device}**; "
            f"context {handlers.context} tokens.",
            elem_id="source",
        )
        notice = undertrained_notice(lab)
        if notice:
            gr.Markdown(notice, elem_id="undertrained")
        with gr.Row(equal_height=True):
            for group, m, error in lab.columns():
                with gr.Column():
                    if m is None:
                        gr.Markdown(
                            failed_card(group, error),
                            elem_id=f"card-{group}",
                            elem_classes=["model-card", "model-error"],
                        )
                    else:
                        gr.Markdown(model_card(m, lab.device), elem_id=f"card-{m.group}", elem_classes="model-card")

        gr.Markdown("## Generate")
        prompt = gr.Textbox(
            DEFAULT_PROMPT,
            label="Prompt",
            lines=3,
            elem_id="prompt",
            info=f"sent to every model; fewer than {handlers.context} tokens",
        )
        with gr.Row():
            max_new = gr.Slider(
                *LIMITS["max_new_tokens"], value=max(1, min(60, handlers.context - 24)), step=1, label="max new tokens"
            )
            temperature = gr.Slider(
                *LIMITS["temperature"],
                value=SamplingConfig.temperature,
                step=0.05,
                label="temperature",
                info="0: always the most likely token",
            )
            top_k = gr.Slider(*LIMITS["top_k"], value=SAMPLE_TOP_K, step=1, label="top-k", info="0: off")
            top_p = gr.Slider(*LIMITS["top_p"], value=SamplingConfig.top_p, step=0.01, label="top-p", info="1: off")
            seed = gr.Number(
                1234,
                label="seed",
                precision=0,
                minimum=LIMITS["seed"][0],
                maximum=LIMITS["seed"][1],
                info="same seed, same texts",
            )
        with gr.Row():
            go = gr.Button("Generate", variant="primary", elem_id="generate-btn")
            stop = gr.Button("Stop", elem_id="stop-btn")
        outputs = []
        with gr.Row(equal_height=True):
            for group, m, _ in lab.columns():
                if m is None:
                    gr.Markdown(
                        f"*{group_label(group)} did not load: its card above says why.*", elem_id=f"out-{group}-missing"
                    )
                else:
                    outputs.append(
                        gr.Textbox(label=m.label, lines=8, max_lines=20, interactive=False, elem_id=f"out-{m.group}")
                    )

        gr.Markdown(
            "## Attention\nOver the prompt and the chosen model's generated text "
            "(the last tokens that fit the context). Rows are queries, columns the tokens "
            "they attend to."
        )
        max_layers = max(m.cfg.n_layer for m in lab.models)
        max_heads = max(m.cfg.n_head for m in lab.models)
        with gr.Row():
            model_dd = gr.Dropdown(
                [(m.label, m.group) for m in lab.models],
                value=lab.models[-1].group,
                label="model",
                elem_id="attn-model",
            )
            layer = gr.Slider(
                0,
                max(max_layers - 1, 1),
                value=0,
                step=1,
                label="layer",
                elem_id="attn-layer",
                info=f"0..{max_layers - 1}",
            )
            head = gr.Dropdown(
                [("mean over heads", MEAN_HEAD)] + [(f"head {h}", str(h)) for h in range(max_heads)],
                value=MEAN_HEAD,
                label="head",
                elem_id="attn-head",
            )
            show = gr.Button("Show attention", elem_id="attn-btn")
        with gr.Row():
            heat = gr.Plot(label="attention map", show_label=False, elem_id="attn-plot")
        compare = gr.Plot(label="the three models, same layer and head", show_label=False, elem_id="attn-compare")
        gr.Markdown(
            "### Per-head summaries\nEntropy: how spread a head's attention is (uniform "
            "attention is the dashed line). Distance: how many tokens back it looks on average. "
            "Hollow markers: frozen Q/K."
        )
        summary = gr.Plot(label="per-head summaries", show_label=False, elem_id="attn-summary")
        table = gr.Dataframe(
            headers=["model", "layer", "head", "Q/K", "entropy (nats)", "mean distance (tokens)"],
            label="per-head summaries",
            interactive=False,
            elem_id="attn-table",
        )
        with gr.Accordion("map details", open=False):
            details = gr.JSON(label="tokens and shape of the map", elem_id="attn-details")

        generated = gr.State()  # the token ids behind the texts, per session
        gen_inputs = [prompt, max_new, temperature, top_k, top_p, seed]
        attn_inputs = [prompt, model_dd, layer, head, generated, *outputs]
        attn_outputs = [heat, compare, summary, table, details]
        # preprocess=False: the values reach the handlers as sent, and their checks, which name the
        # setting and its range, answer instead of the components' ("Value 0 is less than minimum
        # value 1.", or "Could not preprocess input component at index 1" for a wrong type).
        raw = dict(preprocess=False)
        gen = go.click(handlers.generate, gen_inputs, [*outputs, generated], api_name="generate", **raw)
        gen.success(handlers.attention, attn_inputs, attn_outputs, api_name=False, **raw)
        submitted = prompt.submit(handlers.generate, gen_inputs, [*outputs, generated], api_name=False, **raw)
        submitted.success(handlers.attention, attn_inputs, attn_outputs, api_name=False, **raw)
        stop.click(None, None, None, cancels=[gen, submitted])
        show.click(handlers.attention, attn_inputs, attn_outputs, api_name="attention", **raw)
    return demo


THEME_FONTS = dict(font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])


def launch(
    demo: gr.Blocks,
    host: str = "127.0.0.1",
    port: int | None = 7860,
    share: bool = False,
    concurrency: int = 2,
    **kwargs,
):
    """Queue (at most ``concurrency`` requests of an event at once, 32 waiting) and serve.

    System fonts only: the default theme would fetch web fonts, which the offline machines lack.
    A port in use is a SetupError naming --port (Gradio's own message names its launch() and an
    environment variable). Unless ``quiet``, the app says where it serves and how to share it
    (--share: Gradio's hint names its launch() argument).
    """
    quiet = kwargs.pop("quiet", False)
    block = not kwargs.pop("prevent_thread_lock", False)
    if port is not None and port_in_use(host, port):
        raise SetupError(port_message(host, port))
    bound_server_memory()
    demo.queue(default_concurrency_limit=concurrency, max_size=32)
    try:
        served = demo.launch(
            server_name=host,
            server_port=port,
            share=share,
            ssr_mode=False,
            show_error=True,
            theme=gr.themes.Soft(**THEME_FONTS),
            css=CSS,
            quiet=True,
            prevent_thread_lock=True,
            **kwargs,
        )
    except OSError as exc:  # taken between the check and the start
        if port is not None and "port" in str(exc).lower():
            raise SetupError(port_message(host, port)) from None
        raise
    if not quiet:
        print(f"* Running on local URL:  {demo.local_url}")
        print(
            f"* Running on public URL: {demo.share_url}"
            if share and demo.share_url
            else "* To create a public link, start the app with --share."
        )
    if block:
        demo.block_thread()
    return served


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on ``port`` at ``host`` already (another demo, a notebook)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Gradio binds: a closed port is free
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def port_message(host: str, port: int) -> str:
    return (
        f"port {port} on {host} is in use (another demo or server is running there): start the app with "
        f"another port, python -m app --port {port + 1} (make demo PORT={port + 1}), or stop the other one"
    )
