"""`kind = "textarena"`: TextArena's single-player games, one game per episode.

    [environment]
    kind = "textarena"
    id = "GuessTheNumber-v0"             # or "GuessTheNumber-v0-raw", "...-hardcore", ...
    params = {max_number = 50}           # keyword arguments of the game
    max_turns = 10

The game's text reaches the model as user messages, one per turn: the opening prompt, then
what the game says back (hints, invalid-move notices). The game's observation wrappers are
left out (they repeat the whole history every turn, which the chat already holds); its action
wrappers (e.g. adding the [brackets] a move needs) are kept; `-raw` ids have none. The reward
is the player's reward from the game's `close()` (1 for a win; some games give partial
credit); an episode that ends before the game does gets 0. Games for two or more players and
games that download data at start (Wordle and other nltk-based games) are refused with a
clear error.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

from retrain.config.sections import EnvironmentConfig
from retrain.environments.kinds import KindContext, MissingExtra
from retrain.environments.protocol import Environment, Message, Step
from retrain.errors import UserError

EXAMPLE = "GuessTheNumber-v0"


class TextArenaGame(Environment):
    """One episode: one single-player TextArena game."""

    def __init__(self, game_id: str, params: dict):
        self.game = make_game(game_id, params)
        self.player = 0
        self.rewards: dict | None = None
        self.info: dict = {}
        self.closed = False

    def reset(self, seed: int) -> list[Message]:
        self.game.reset(num_players=1, seed=seed)
        return self._observe() or [{"role": "user", "content": "Your move."}]

    def step(self, reply: str) -> Step:
        done, _ = self.game.step(reply)
        if done:
            self._finish()
            return Step(done=True, metrics=self._metrics())
        return Step(messages=self._observe())

    def close(self) -> float:
        self._finish()
        reward = (self.rewards or {}).get(self.player, 0.0)
        return float(reward or 0.0)

    def _observe(self) -> list[Message]:
        """What the game said since the model's last move, as one user message."""
        self.player, obs = self.game.get_observation()
        texts = [text for source, text, *_ in obs if source != self.player] \
            if isinstance(obs, list) else [str(obs)]
        content = "\n".join(t for t in texts if t)
        return [{"role": "user", "content": content}] if content else []

    def _finish(self) -> None:
        if not self.closed:
            self.closed = True
            self.rewards, info = self.game.close()
            self.info = (info or {}).get(self.player, {}) if isinstance(info, dict) else {}

    def _metrics(self) -> dict[str, float]:
        return {"invalid_move": float(bool(self.info.get("invalid_move")))}


def build(cfg: EnvironmentConfig, ctx: KindContext) -> Callable[[], Environment]:
    """Episodes of the game `cfg.id` with `cfg.params`; checks the game once, here."""
    if not cfg.id:
        raise UserError(f"environment.id: name the textarena game, e.g. id = '{EXAMPLE}'")
    game_id, params = cfg.id, dict(cfg.params)
    probe = TextArenaGame(game_id, params)
    try:
        probe.reset(seed=0)
    except AssertionError as exc:  # textarena asserts the number of players
        raise UserError(f"environment.id = {game_id!r}: {exc}; only single-player games "
                        f"run as environments (e.g. '{EXAMPLE}')") from None
    return lambda: TextArenaGame(game_id, params)


def make_game(game_id: str, params: dict) -> Any:
    """The game without its observation wrappers; UserError for what cannot run here."""
    try:
        import textarena
        from textarena.envs.registration import ENV_REGISTRY
    except ImportError:
        raise MissingExtra("textarena") from None
    spec = ENV_REGISTRY.get(game_id)
    if spec is None:
        import difflib

        close = difflib.get_close_matches(game_id, list(ENV_REGISTRY), n=3)
        hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else \
            f"e.g. '{EXAMPLE}'"
        raise UserError(f"environment.id: textarena has no game {game_id!r}; {hint}")
    raw_id = game_id if game_id.endswith("-raw") or f"{game_id}-raw" not in ENV_REGISTRY \
        else f"{game_id}-raw"
    try:
        # what a game prints while it is built stays off the worker's stdout (nltk still
        # writes its failed downloads to the real stderr: noise, not harm)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            game = textarena.make(raw_id, **params)
    except LookupError as exc:  # nltk: a corpus that is downloaded on first use
        raise UserError(f"environment.id = {game_id!r} needs data textarena downloads on first "
                        f"use ({_first_line(exc)}), and this machine has no copy; fetch it "
                        "once where there is a network (python -m nltk.downloader NAME, then "
                        f"set NLTK_DATA) or pick a game that runs offline, e.g. '{EXAMPLE}'") \
            from None
    except TypeError as exc:
        raise UserError(f"environment.params: {game_id} does not take these settings ({exc})") \
            from None
    for wrapper in spec.default_wrappers or []:
        if issubclass(wrapper, textarena.ActionWrapper):
            game = wrapper(game)
    return game


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return next((line for line in lines if "not found" in line), lines[0] if lines else "")
