"""Tools the model may call during an episode: the wrapper (`with_tools`), schemas from type
hints, the call format, the text protocol for templates without tools, built-in tools and
the built-in tool task (`lookup`)."""

from retrain.environments.tools.wrapper import ToolEnvironment, with_tools

__all__ = ["ToolEnvironment", "with_tools"]
