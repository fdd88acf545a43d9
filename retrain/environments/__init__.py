"""What the model is asked and how it is scored: the Environment protocol, prompt sources
(tasks), answers, rewards and the worker process that scores them."""

from retrain.environments.protocol import Environment, Message, Step

__all__ = ["Environment", "Message", "Step"]
