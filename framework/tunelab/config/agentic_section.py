"""The ``agentic`` section of grpo_distributed: multi-turn episodes with tools and environments.

Its own module (beside ``sections``) so that it reads as one concern; owned by
``tunelab.rl.agentic.EpisodeGroupSampler``. This module must not import torch.
"""

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from tunelab.config._args import Component, component
from tunelab.config.constraints import Finite, NonEmpty, Range
from tunelab.config.sections import AtLeastOne


@dataclass(kw_only=True)
class AgenticArgs:
    """Agentic GRPO: each completion is an episode of turns in which the policy may call tools."""

    tools: list[Component] | None = component(required=False, called_later=True)
    """Tools every episode may call: typed, docstringed functions (tunelab.rl.agentic.calculator) or classes whose public methods are tools (tunelab.rl.agentic.PythonSandbox, with its limits as keys)."""
    environments: list[Component] | None = component(required=False)
    """Environment classes (tunelab.rl.agentic.Environment subclasses, settings as keys): one instance per episode, its methods are tools; a row names its class in an environment column (one configured: every row)."""
    tool_format: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"
    """How tool calls are parsed from the generated text: auto reads the chat template (<tool_call>: hermes; [TOOL_CALLS]: mistral; ipython: llama3_json)."""
    prompt_column: Annotated[str, NonEmpty()] = "prompt"
    """The dataset column holding the prompt (a string or a list of messages), rendered with the tools by the chat template."""
    max_turns: AtLeastOne = 4
    """Policy replies per episode at most."""
    max_tool_calls: AtLeastOne = 8
    """Tool calls per episode at most (a reply that would pass it ends the episode)."""
    max_episode_tokens: AtLeastOne = 256
    """Tokens after the prompt per episode at most: replies, template tokens and tool results (the KV cache holds prompt + this); rollout.max_new_tokens bounds each reply."""
    tool_timeout_s: Annotated[float, Finite(), Range(gt=0)] = 10.0
    """Seconds one tool call may take; past it the call is a timeout error the model reads."""
    max_tool_result_chars: AtLeastOne = 2000
    """A tool result is cut to this many characters before it is rendered (the cut marked with " [...]")."""
    max_tool_result_tokens: AtLeastOne = 256
    """A tool result (an error message included) is cut to this many tokens, " [...]" included, so one call cannot fill the episode's max_episode_tokens."""
    tool_workers: AtLeastOne = 8
    """Episodes whose tool calls run at the same time (threads)."""
    tool_processes: Annotated[int, Range(ge=0)] = 2
    """Worker processes per rank running plain function tools, so a call past tool_timeout_s or one that crashes is killed and its worker restarted; 0: threads (environments' tools and tool classes always run in threads)."""
    environment_reward_weight: Annotated[float, Finite()] = 1.0
    """Weight of the environment's own reward() in the total reward (added to the weighted rewards.functions)."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra chat-template variables for the episodes' renders (e.g. {enable_thinking: true})."""
