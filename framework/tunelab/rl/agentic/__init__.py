"""Agentic RL: multi-turn episodes in which the policy calls tools and environments.

One module per concern:

- tools: :class:`Tool`, :func:`tool_from_function` (the schema ``transformers`` derives),
  :func:`call_tool` (every failure a result the model reads) (``tools.py``); the built-ins
  :func:`calculator` (``calculator.py``) and :class:`PythonSandbox` (``sandbox.py``);
- environments: :class:`Environment` and the example :class:`KeyValueStore`
  (``environments.py``); :class:`Toolbox` (the config's tools and environments,
  ``toolbox.py``);
- parsing: :func:`parse_assistant` (tool calls in the model's own format, ``tool_calls.py``);
- rollouts: :class:`CachedTurnSampler` (one KV cache across an episode's turns,
  ``turn_sampler.py``), :class:`EpisodeRunner`, :class:`Episode`, :func:`episode_batch`
  (token in, token out; only the policy's tokens trained, ``episodes.py``);
- GRPO: :class:`EpisodeGroupSampler` (G episodes per prompt, scored on the whole episode,
  ``groups.py``), what ``grpo_distributed`` uses when its config has an ``agentic`` section;
  :func:`tool_call_reward` (a reward that reads the whole episode, ``rewards.py``).

See docs/recipes.md (agentic GRPO) for the contract.
"""

from tunelab.rl.agentic.calculator import calculator
from tunelab.rl.agentic.environments import Environment, KeyValueStore
from tunelab.rl.agentic.episodes import (
    STOP_REASONS,
    Episode,
    EpisodeLimits,
    EpisodeRunner,
    episode_batch,
    episode_prompt,
)
from tunelab.rl.agentic.groups import EpisodeGroupSampler, episode_sums
from tunelab.rl.agentic.rewards import tool_call_reward
from tunelab.rl.agentic.sandbox import PythonSandbox, SandboxLimits
from tunelab.rl.agentic.tool_calls import FORMATS, detect_format, parse_assistant
from tunelab.rl.agentic.toolbox import EpisodeTools, Toolbox
from tunelab.rl.agentic.tools import (
    ERROR_KINDS,
    Tool,
    ToolCall,
    ToolFailure,
    ToolResult,
    call_tool,
    tool_from_function,
)
from tunelab.rl.agentic.turn_sampler import CachedTurnSampler

__all__ = [
    "CachedTurnSampler",
    "ERROR_KINDS",
    "Environment",
    "Episode",
    "EpisodeGroupSampler",
    "EpisodeLimits",
    "EpisodeRunner",
    "EpisodeTools",
    "FORMATS",
    "KeyValueStore",
    "PythonSandbox",
    "STOP_REASONS",
    "SandboxLimits",
    "Tool",
    "ToolCall",
    "ToolFailure",
    "ToolResult",
    "Toolbox",
    "calculator",
    "call_tool",
    "detect_format",
    "episode_batch",
    "episode_prompt",
    "episode_sums",
    "parse_assistant",
    "tool_call_reward",
    "tool_from_function",
]
