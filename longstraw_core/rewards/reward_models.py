"""Reward models: a sequence-classification model named in ``rewards`` (a local directory or
a Hub id), scored as TRL 1.16's ``GRPOTrainer`` scores a ``reward_funcs`` string.

TRL loads such an entry with ``AutoModelForSequenceClassification.from_pretrained(name,
num_labels=1)`` and its tokenizer (``reward_processing_classes``; a missing pad token becomes
the EOS token, and the model's ``pad_token_id`` the tokenizer's, since the model reads the
last non-padded token). Each completion's text is its prompt and completion: concatenated for
a text prompt, the chat template over the prompt's messages and the completion's for a chat
prompt (``chat_template_kwargs`` passed on); tokenized as one batch padded on the right,
without special tokens; the reward is ``logits[:, 0]``, under ``inference_mode``. The name in
the metrics is the last part of the model's name or path (``rewards/<name>/mean``).

LongStraw differs in where and how much at once: a ``RewardModel`` runs on its own
``device`` (default: the run's, the current CUDA device or the CPU) in batches of
``batch_size`` texts (default: a call's every completion at once, TRL's), since a long
prompt repeated G times may not fit one pass. Each rank that scores holds its own copy (as
TRL's replicas do: every rank, or on pipeline stages each pipeline's last stage), beside
the policy: the memory planner does not count it.

Why the configuration is read eagerly and the weights lazily: the config check resolves
every reward at load time, so a path that is neither a reward function nor a loadable
classifier is refused in one line before anything expensive; the weights load once per
process (``reward_model`` keeps one object per entry), when the run sets up (``load``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longstraw_core.rewards.imports import RewardNameError
from longstraw_core.rewards.inputs import Completion, is_conversational

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_LOADED: dict[str, RewardModel] = {}


def is_model_name(spec: str) -> bool:
    """Whether a reward entry names a model rather than a function: a directory that exists,
    or a name with a ``/`` (a Hub id ``org/name`` or a path; a Python dotted path has none)."""
    return "/" in spec or Path(spec).expanduser().is_dir()


def reward_model(
    spec: str,
    *,
    device: str | None = None,
    batch_size: int | None = None,
    init_kwargs: Mapping[str, Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> RewardModel:
    """The ``RewardModel`` of these settings, made once per process (the config check and
    the run share it, and its weights load once)."""
    key = json.dumps(
        [spec, device, batch_size, dict(init_kwargs or {}), dict(chat_template_kwargs or {})],
        sort_keys=True,
        default=repr,
    )
    if key not in _LOADED:
        _LOADED[key] = RewardModel(
            spec, device=device, batch_size=batch_size, init_kwargs=init_kwargs,
            chat_template_kwargs=chat_template_kwargs,
        )  # fmt: skip
    return _LOADED[key]


class RewardModel:
    """A sequence-classification model called as a reward function (TRL's keyword call):
    one ``logits[:, 0]`` per completion, as a float."""

    def __init__(
        self,
        path: str,
        *,
        device: str | None = None,
        batch_size: int | None = None,
        init_kwargs: Mapping[str, Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if batch_size is not None and batch_size < 1:
            raise RewardNameError(f"batch_size must be >= 1, got {batch_size}", "batch_size")
        if device is not None:
            import torch

            try:
                torch.device(device)
            except RuntimeError:
                raise RewardNameError(
                    f"{device!r} is not a torch device; e.g. 'cpu', 'cuda', 'cuda:1'", "device"
                ) from None
        self.path = path
        self.device = device
        self.batch_size = batch_size
        self.init_kwargs = dict(init_kwargs or {})
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.__name__ = path.rstrip("/").split("/")[-1]  # TRL: the model id's last part
        self._check_classifier()
        self.tokenizer = self._tokenizer()
        self.model: PreTrainedModel | None = None

    def _check_classifier(self) -> None:
        """The path holds a config that transformers maps to a sequence classifier."""
        from transformers import AutoConfig, AutoModelForSequenceClassification

        trust = bool(self.init_kwargs.get("trust_remote_code", False))
        try:
            config = AutoConfig.from_pretrained(self.path, trust_remote_code=trust)
        except (OSError, ValueError) as exc:
            raise RewardNameError(
                f"reward {self.path!r} is not a reward function (a built-in or "
                "'package.module:function'), nor a model transformers can load "
                f"({_first_line(exc)}); give a sequence-classification model's directory "
                "or Hub id"
            ) from None
        mapped = type(config) in AutoModelForSequenceClassification._model_mapping
        if not mapped and not getattr(config, "auto_map", {}).get(
            "AutoModelForSequenceClassification"
        ):
            raise RewardNameError(
                f"reward model {self.path!r} is a {config.model_type!r} model, which "
                "transformers has no sequence-classification class for "
                "(AutoModelForSequenceClassification); give a reward model (one score per "
                "text)"
            )

    def _tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's own tokenizer, with TRL's pad token (the EOS when it has none)."""
        from transformers import AutoTokenizer

        trust = bool(self.init_kwargs.get("trust_remote_code", False))
        try:
            tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=trust)
        except (OSError, ValueError, TypeError) as exc:
            raise RewardNameError(
                f"reward model {self.path!r} has no tokenizer transformers can load "
                f"({_first_line(exc)}); save its tokenizer beside it (TRL's "
                "reward_processing_classes)"
            ) from None
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def load(self) -> None:
        """Load the weights onto the device, frozen, once."""
        if self.model is not None:
            return
        from transformers import AutoModelForSequenceClassification

        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                self.path, num_labels=1, **self.init_kwargs
            )
        except (OSError, ValueError, TypeError) as exc:
            raise RewardNameError(
                f"reward model {self.path!r} could not be loaded: {_first_line(exc)}"
            ) from None
        model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id
        self.model = model.to(self._device()).eval().requires_grad_(False)

    def _device(self) -> torch.device:
        import torch

        if self.device is not None:
            return torch.device(self.device)
        if torch.cuda.is_available():  # the rank's GPU, which accelerate made current
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def texts(self, prompts: Sequence[Any], completions: Sequence[Completion]) -> list[str]:
        """What the model reads per completion: TRL's prompt + completion (module doc)."""
        if prompts and is_conversational(prompts[0]):
            return [
                self.tokenizer.apply_chat_template(
                    [*p, *c], tokenize=False, **self.chat_template_kwargs
                )
                for p, c in zip(prompts, completions, strict=True)
            ]
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Completion], **kwargs: Any
    ) -> list[float]:
        import torch

        self.load()
        assert self.model is not None
        texts = self.texts(prompts, completions)
        size = self.batch_size or max(len(texts), 1)
        scores: list[float] = []
        for start in range(0, len(texts), size):
            inputs = self.tokenizer(
                text=texts[start : start + size], return_tensors="pt", padding=True,
                padding_side="right", add_special_tokens=False,
            ).to(self.model.device)  # fmt: skip
            with torch.inference_mode():
                scores += self.model(**inputs).logits[:, 0].float().tolist()
        return scores


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
