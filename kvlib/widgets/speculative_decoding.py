"""The speculative_decoding lesson: step through a speculative generation, one round at a time.

``speculative_explorer(target, draft, tokenizer)`` runs kvlib.serving's SpeculativeDecoder:
every click on "Speculative round" lets the draft propose k tokens and the target judge them
in one pass. The figure shows the round (``draw_round``): the draft's proposals coloured by
the target's verdict (kept, rejected, not judged), the tokens the round keeps (the accepted
proposals and the target's own token, a correction or a bonus), and both caches' lengths
before the round, after its passes and after the truncation. The lines under the controls
give the acceptance statistics so far beside the prediction from them.
"""

from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

import kvlib
from kvlib import plots
from kvlib.serving.speculative import (
    GreedyAcceptance,
    SamplingAcceptance,
    SpeculativeDecoder,
    SpeculativeStep,
    expected_tokens_per_pass,
)

from .base import LiveFigure, as_html, safely, wire_reset

KEPT_COLOR = "#5ec962"        # viridis green: an accepted proposal
REJECTED_COLOR = "#3b528b"    # viridis blue, hatched: the first rejected proposal
TARGET_COLOR = "#fde725"      # viridis yellow: the target's own token
UNJUDGED_COLOR = "#ffffff"    # after the first rejection the target rules on nothing
CONTEXT_COLOR = "#e8e8e8"
CONTEXT_SHOWN = 4             # tokens of the sequence shown before the round
TOP = 1.5                     # height of the proposals' row above the kept row
RULES = {"greedy": "greedy", "sampling (T = 1)": "sampling"}
SAMPLING_SEED = 0


def _box(ax, x: float, y: float, text: str, color: str, *, hatch=None, edge="black",
         linestyle="-", text_color="black", weight="normal") -> None:
    ax.add_patch(Rectangle((x + 0.05, y - 0.35), 0.9, 0.7, facecolor=color, edgecolor=edge,
                           hatch=hatch, linestyle=linestyle, linewidth=1.0))
    ax.text(x + 0.5, y, text, ha="center", va="center", fontsize=9, color=text_color,
            weight=weight, clip_on=True)


def _verdict_note(step: SpeculativeStep, index: int, sampled: bool) -> str:
    if index >= step.judged:
        return "not judged"
    kept = index < step.accepted
    mark = "kept" if kept else "rejected"
    if sampled:
        return f"{mark}\nmin(1, p/q) = {step.acceptance[index]:.2f}"
    return mark


def draw_round(token_ax, cache_ax, step: SpeculativeStep, context, label, *,
               sampled: bool = False) -> None:
    """Draw one round of speculative decoding (speculative_decoding) into two Axes, cleared first.

    token_ax: the draft's proposals (top row), coloured by the target's verdict, and the
    tokens the round keeps (bottom row, after the last tokens of the sequence, `context`):
    the accepted proposals, then the target's own token under the first rejected proposal
    (a correction) or after the last one (a bonus). cache_ax: the target's and the draft's
    cache, positions held before the round, written by its passes, and truncated after it.
    label: ids -> token strings (tokenizer.tokens). sampled: also print min(1, p/q).
    """
    if not isinstance(step, SpeculativeStep):
        raise TypeError(f"step must be a SpeculativeStep, got {type(step).__name__}")
    context = list(context)[-CONTEXT_SHOWN:]
    k = len(step.proposals)
    words = label(list(step.proposals) + [step.next_token] + context)
    proposal_words, target_word = words[:k], words[k]
    context_words = words[k + 1:]
    token_ax.clear()
    start = len(context_words)          # column of the first proposal
    for column, word in enumerate(context_words):
        _box(token_ax, column, 0, word, CONTEXT_COLOR, edge="#999999")
    for index, word in enumerate(proposal_words):
        x = start + index
        if index < step.accepted:
            _box(token_ax, x, TOP, word, KEPT_COLOR)
            _box(token_ax, x, 0, word, KEPT_COLOR)
        elif index < step.judged:
            _box(token_ax, x, TOP, word, REJECTED_COLOR, hatch="//", text_color="white",
                 weight="bold")
        else:
            _box(token_ax, x, TOP, word, UNJUDGED_COLOR, edge="#999999", linestyle="--",
                 text_color="#777777")
        token_ax.text(x + 0.5, TOP + 0.42, f"proposal {index + 1}", ha="center",
                      va="bottom", fontsize=7, color="#555555")
        token_ax.text(x + 0.5, TOP / 2, _verdict_note(step, index, sampled), ha="center",
                      va="center", fontsize=7)
    x = start + step.accepted
    _box(token_ax, x, 0, target_word, TARGET_COLOR, weight="bold", edge="black")
    token_ax.text(x + 0.5, -0.5, "bonus" if step.bonus else "target's token", ha="center",
                  va="top", fontsize=7)
    columns = start + max(k, step.accepted + 1)
    token_ax.set_xlim(-1.6, max(columns, 6) + 0.2)
    token_ax.set_ylim(-0.9, TOP + 0.8)
    token_ax.set_yticks([0, TOP], ["kept", "draft\nproposes"])
    token_ax.tick_params(length=0)
    token_ax.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        token_ax.spines[side].set_visible(False)
    if context_words:
        token_ax.text(-0.1, 0, "...", ha="right", va="center", fontsize=9)
    if step.bonus:
        outcome = f"kept all {k} and added a bonus token"
    else:
        outcome = f"kept {step.accepted} and added its own token"
    title = f"Round at position {step.start}: the draft proposed {k}, the target {outcome}"
    token_ax.set_title(title, fontsize=10)
    token_ax.legend(handles=[Patch(facecolor=KEPT_COLOR, edgecolor="black", label="accepted"),
                             Patch(facecolor=REJECTED_COLOR, hatch="//", edgecolor="black",
                                   label="rejected"),
                             Patch(facecolor=UNJUDGED_COLOR, edgecolor="#999999",
                                   linestyle="--", label="not judged"),
                             Patch(facecolor=TARGET_COLOR, edgecolor="black",
                                   label="target's own token")],
                    loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    _draw_caches(cache_ax, step)


def _draw_caches(ax, step: SpeculativeStep) -> None:
    ax.clear()
    lengths = (step.target_lengths, step.draft_lengths)
    for y, (before, written, after) in enumerate(lengths):
        ax.barh(y, before, color=plots.OLD_ROWS_COLOR, edgecolor="black", linewidth=0.5)
        ax.barh(y, after - before, left=before, color=KEPT_COLOR, edgecolor="black",
                linewidth=0.5)
        ax.barh(y, written - after, left=after, color="white", edgecolor="black",
                hatch="//", linewidth=0.5)
        ax.text(written + 0.3, y, f"{before} -> {written} -> {after} positions", va="center",
                fontsize=8)
    lowest = min(step.target_lengths[0], step.draft_lengths[0])
    highest = max(step.target_lengths[1], step.draft_lengths[1])
    ax.set_xlim(max(0, lowest - 8), highest + 9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_yticks([0, 1], ["target's cache", "draft's cache"])
    ax.invert_yaxis()
    ax.set_xlabel("positions held in the cache (before the round, written by it, kept)")
    ax.legend(handles=[Patch(facecolor=plots.OLD_ROWS_COLOR, edgecolor="black",
                             label="held before the round"),
                       Patch(facecolor=KEPT_COLOR, edgecolor="black",
                             label="written and kept"),
                       Patch(facecolor="white", hatch="//", edgecolor="black",
                             label="written, then truncated")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)


FIGURE_SIZE = (11, 4.2)


def _round_axes(figure):
    """The two Axes draw_round fills: tokens above, caches below."""
    grid = figure.add_gridspec(2, 1, height_ratios=[1.6, 1.0], hspace=0.45)
    figure.subplots_adjust(left=0.12, right=0.8, top=0.9, bottom=0.13)
    return [figure.add_subplot(grid[0]), figure.add_subplot(grid[1])]


def plot_round(step: SpeculativeStep, context, label, *, sampled: bool = False):
    """One round as a plain figure (speculative_decoding; GitHub shows no widgets): a new figure
    with draw_round's two Axes. Returns the figure."""
    figure = plt.figure(figsize=FIGURE_SIZE)
    draw_round(*_round_axes(figure), step, context, label, sampled=sampled)
    return figure


def round_figure():
    """A LiveFigure (made once, redrawn in place) with draw_round's two Axes."""
    live = LiveFigure(figsize=FIGURE_SIZE, n_axes=1)
    live.figure.clear()
    live.axes = _round_axes(live.figure)
    return live


def _stats_line(decoder: SpeculativeDecoder) -> str:
    stats = decoder.stats()
    text = (f"So far: {stats.rounds} rounds, so {stats.target_passes} target passes, for "
            f"{stats.new_tokens} tokens: <b>{stats.tokens_per_pass:.2f} tokens a pass</b> "
            f"(plain decoding: 1.00). The draft ran {stats.draft_passes} passes.")
    if stats.judged:
        alpha = stats.acceptance_rate
        predicted = expected_tokens_per_pass(alpha, decoder.k)
        text += (f"<br>The target accepted {stats.accepted} of the {stats.judged} proposals "
                 f"it judged: alpha = {alpha:.2f}, for which (1 - alpha<sup>k+1</sup>) / "
                 f"(1 - alpha) predicts {predicted:.2f} tokens a pass at k = {decoder.k}.")
    return text


def _greedy_check(decoder: SpeculativeDecoder) -> str:
    """One forward pass of the target over the sequence: is every new token its argmax?"""
    sequence, start = decoder.sequence, decoder.prompt_length
    rows = kvlib.forward(decoder.target, sequence[:-1])[start - 1:]
    same = np.array_equal(np.argmax(rows, axis=-1), sequence[start:])
    if same:
        return (f"All {len(sequence) - start} new tokens are the target's own greedy tokens "
                "(checked with one forward pass of the target over the whole sequence).")
    return "<b>The tokens differ from the target's own greedy tokens.</b>"


def speculative_explorer(target, draft, tokenizer, prompt: str, k: int = 4,
                         rule: str = "greedy"):
    """Speculative decoding one round a click (speculative_decoding).

    target, draft: kvlib Params with the same vocabulary; tokenizer: encode(text) -> ids and
    tokens(ids) -> strings (kvlib.ToyTokenizer, kvlib.stories.StoryTokenizer). The prompt
    is prefilled by the first round. Controls: "Speculative round", "Reset", k (a slider,
    1-8; changing it starts again), the rule ("greedy" or "sampling (T = 1)", seeded) and
    the prompt. A refused prompt is explained in ``message``; until a prompt is accepted,
    "Speculative round" advances nothing and says why (the figure still shows the previous
    prompt's run, and the status line says so).

    Returns a VBox with what the tests use: ``controls`` ({"round", "reset", "k", "rule",
    "prompt"}), ``status`` (HTML: what the last round did), ``stats`` (HTML: totals and the
    prediction), ``check`` (HTML: greedy output against the target's own), ``message``
    (bad input in words), ``figure``, and ``state`` ({"decoder": the SpeculativeDecoder}).
    """
    step_button = widgets.Button(description="Speculative round", button_style="primary")
    reset_button = widgets.Button(description="Reset")
    k_slider = widgets.IntSlider(value=k, min=1, max=8, description="k",
                                 continuous_update=False)
    rule_buttons = widgets.ToggleButtons(options=list(RULES), value=_rule_label(rule),
                                         description="rule")
    text = widgets.Text(value=prompt, description="prompt", continuous_update=False,
                        layout=widgets.Layout(width="24em"))
    status, stats, check, message = (widgets.HTML() for _ in range(4))
    live = round_figure()
    state: dict = {}

    def acceptance():
        if RULES[rule_buttons.value] == "greedy":
            return GreedyAcceptance()
        return SamplingAcceptance(1.0, seed=SAMPLING_SEED)

    def show(step: SpeculativeStep):
        decoder = state["decoder"]
        # from the decoder, not the toggle: after a refused prompt the toggle may be ahead of it
        sampled = isinstance(decoder.acceptance, SamplingAcceptance)
        context = decoder.sequence[: step.start]
        draw_round(live.axes[0], live.axes[1], step, context, tokenizer.tokens,
                   sampled=sampled)
        live.show()
        kept = as_html(" ".join(tokenizer.tokens(list(step.kept))))
        before = as_html(" ".join(tokenizer.tokens(context[decoder.prompt_length:])))
        if step.bonus:
            verdict = (f"the target accepted all {len(step.proposals)} and added a bonus "
                       "token from its last row")
        elif step.proposals:
            rejected = tokenizer.tokens([step.proposals[step.accepted]])[0]
            verdict = (f"the target accepted {step.accepted}, rejected "
                       f"\"{as_html(rejected)}\" and put its own token in its place")
        else:
            verdict = "no room for proposals (the context is nearly full): the target's own step"
        target_lengths, draft_lengths = step.target_lengths, step.draft_lengths
        status.value = (
            f"Round {len(decoder.steps)}: the draft proposed {len(step.proposals)} tokens; "
            f"{verdict}. Kept {len(step.kept)}: <b>{kept}</b>.<br>"
            f"Caches: target {target_lengths[0]} -> {target_lengths[1]} -> {target_lengths[2]}"
            f", draft {draft_lengths[0]} -> {draft_lengths[1]} -> {draft_lengths[2]} positions "
            "(before, after the passes, after the truncation).<br>"
            f"Generated: {before} <b>{kept}</b>")
        stats.value = _stats_line(decoder)
        check.value = _greedy_check(decoder) if not sampled else (
            "Sampled: each token is distributed as the target's own sample (checked exactly "
            "in the notebook); the same seed gives the same tokens.")
        # a round needs the sequence's last token to fit: at most context_length tokens
        full = len(decoder.sequence) > decoder.target.config.context_length
        step_button.disabled = full
        if full:
            status.value += ("<br><b>The context is full</b>: no further token fits. Press "
                             "Reset to start again.")

    def on_reset(*_):
        try:
            ids = tokenizer.encode(text.value)
            if len(ids) >= target.config.context_length:
                raise ValueError(f"this prompt has {len(ids)} tokens; at most "
                                 f"{target.config.context_length - 1} fit here")
            decoder = SpeculativeDecoder(target, draft, ids, k_slider.value, acceptance())
        except (ValueError, TypeError) as error:
            # the run on show is the previous prompt's: say so, and let no round advance it
            state["refused"] = str(error)
            if "decoder" in state:
                status.value = ("<b>The prompt was refused</b> (the line above says why): "
                                "nothing runs. The figure and the lines below are the "
                                "previous prompt's run, and \"Speculative round\" advances "
                                "nothing until a prompt is accepted.")
            raise
        step = decoder.step()
        state["decoder"], state["refused"] = decoder, None
        step_button.disabled = False
        show(step)

    def on_round(_button):
        if state.get("refused") is not None:
            raise ValueError(f"a round advances nothing while the prompt is refused "
                             f"({state['refused']}): the figure shows the previous prompt's "
                             "run. Change the prompt to start again.")
        decoder = state.get("decoder")
        if decoder is None or len(decoder.sequence) > target.config.context_length:
            step_button.disabled = True
            return
        show(decoder.step())

    step_button.on_click(safely(on_round, message))
    wire_reset(on_reset, message, reset_button, [k_slider, rule_buttons, text])

    controls = {"round": step_button, "reset": reset_button, "k": k_slider,
                "rule": rule_buttons, "prompt": text}
    box = widgets.VBox([widgets.HBox([step_button, reset_button, k_slider]),
                        widgets.HBox([rule_buttons, text]), message, status, stats, check,
                        live.output])
    box.controls, box.status, box.stats, box.check, box.message = (
        controls, status, stats, check, message)
    box.figure, box.state = live.figure, state
    return box


def _rule_label(rule: str) -> str:
    for label, name in RULES.items():
        if rule in (label, name):
            return label
    raise ValueError(f"rule must be 'greedy' or 'sampling', got {rule!r}")
