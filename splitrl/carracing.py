"""CarRacing drawn for less CPU, pixel for pixel as gymnasium draws it.

gymnasium's CarRacing draws each frame on a 1000x800 surface and shrinks it to the 96x96 observation. Two of its
costs per frame are far above what drawing it needs, and `draw_faster` cuts both for one env:

- **The road pass.** It takes every polygon of the field, the grass and the track (about 750 on a typical
  track) through pygame's ``Vector2`` one vertex at a time in Python, then skips those off screen, which is most
  of them: about half of a stock env step's CPU. The env gets a road pass that turns the track's vertices all at
  once with numpy and hands the same visible polygons, with the same coordinates, to the same ``gfxdraw`` calls:

  - the rotation's cosine and sine are pygame's own: ``Vector2(1, 0).rotate_rad(angle)`` is ``(cos, sin)`` as
    pygame computes them (its angle folded into one turn, quarter turns exact), and ``cos*x - sin*y``,
    ``sin*x + cos*y`` are the products and sums pygame's rotation makes, in the same order, in float64;
  - then the zoom and the translation, and the same off-screen test, polygon by polygon;
  - a tile's colour is read at each frame (the env's contact listener repaints tiles as the car touches them).

- **The score's font.** Each frame opens the default font file again (``pygame.font.Font(path, 42)``) and so
  rasterises the score's glyphs afresh: about 0.5 ms a frame, against 5 us for the same text from a font kept
  open. The env's ``_render`` is gymnasium's own code (its code object, not a copy of its source) run with a
  ``pygame`` whose ``font.Font`` hands each thread the one font it keeps for those arguments (a new one once
  pygame's font module was shut down and started again: pygame-ce refuses a font from before, which is how a
  kept one is known to be stale). The glyphs are the same, so the frame is.

So the frames are the stock env's, bit for bit (tests/test_carracing.py steps both through episodes and compares
every frame; `python benchmarks/carracing_road.py` times both side by side). Each is installed only where that was
checked: gymnasium's releases in `CHECKED_GYMNASIUM`; the road on x86-64 (pygame's wheels there compute each
product and sum rounded on its own; a compiler that fuses them into one multiply-add, as arm64 builds may, rounds
otherwise) and where a subclass has replaced neither the road pass nor the polygon drawing; the font with
pygame-ce (whose stale-font check the keeping relies on) and where a subclass has not replaced ``_render``. A copy
or a pickle of the env (gymnasium rebuilds it from its arguments) draws as the stock env does.
"""

from __future__ import annotations

import functools
import threading
import types
from typing import Any, Callable

import numpy as np

__all__ = ["CHECKED_GYMNASIUM", "CHECKED_MACHINES", "draw_faster"]

CHECKED_GYMNASIUM = ("1.4.",)
"""gymnasium releases whose CarRacing frames these passes reproduce (prefixes of ``gymnasium.__version__``)."""
CHECKED_MACHINES = ("x86_64", "AMD64")
"""``platform.machine()`` values where pygame's rotation was checked to round as numpy's products and sums do."""

_MODULE = "gymnasium.envs.box2d.car_racing"


def draw_faster(env: Any) -> bool:
    """Give ``env``'s CarRacing (if it is one) the vectorised road pass and the kept font, each where it was
    checked; whether it gave either."""
    unwrapped = getattr(env, "unwrapped", env)
    if not any(c.__module__ == _MODULE for c in type(unwrapped).__mro__):
        return False  # decided without importing Box2D and pygame for every other env
    import platform

    import gymnasium
    from gymnasium.envs.box2d import car_racing

    if not gymnasium.__version__.startswith(CHECKED_GYMNASIUM) or not isinstance(unwrapped, car_racing.CarRacing):
        return False
    given = False
    if platform.machine() in CHECKED_MACHINES and all(
            getattr(type(unwrapped), name) is getattr(car_racing.CarRacing, name)
            for name in ("_render_road", "_draw_colored_polygon")):  # (else a subclass draws its own road)
        unwrapped._render_road = types.MethodType(_render_road, unwrapped)
        given = True
    render = _render_with_kept_fonts()
    if render is not None and type(unwrapped)._render is car_racing.CarRacing._render:
        unwrapped._render = types.MethodType(render, unwrapped)
        given = True
    return given


class _KeptFonts:
    """``pygame.font`` as CarRacing's ``_render`` reads it, but for ``Font(*args)``: this thread's font of those
    arguments, opened once (again only after pygame's font module was shut down since)."""

    def __init__(self, font: Any, error: type[Exception]) -> None:
        self._font, self._error, self._kept = font, error, threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._font, name)

    def Font(self, *args: Any) -> Any:  # noqa: N802 (pygame's name)
        kept = getattr(self._kept, "fonts", None)
        if kept is None:
            kept = self._kept.fonts = {}
        try:
            font = kept.get(args)
        except TypeError:  # arguments that are no key (a file object): a font of its own, as pygame gives
            return self._font.Font(*args)
        if font is not None:
            try:
                font.get_height()  # pygame-ce refuses a font opened before its font module was last shut down
                return font
            except self._error:
                pass
        font = kept[args] = self._font.Font(*args)
        return font


class _Pygame:
    """pygame with ``font`` replaced by `_KeptFonts`; every other name is pygame's own."""

    def __init__(self, pygame: Any) -> None:
        self._pygame, self.font = pygame, _KeptFonts(pygame.font, pygame.error)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pygame, name)


@functools.cache
def _render_with_kept_fonts() -> Callable[..., Any] | None:
    """gymnasium's ``CarRacing._render``, its own code object, with globals in which ``pygame`` is `_Pygame`;
    None where pygame is not pygame-ce or the module does not name pygame as a global."""
    from gymnasium.envs.box2d import car_racing

    pygame = vars(car_racing).get("pygame")
    if pygame is None or not getattr(pygame, "IS_CE", False):
        return None
    stock = car_racing.CarRacing._render
    namespace = {**vars(car_racing), "pygame": _Pygame(pygame)}
    return types.FunctionType(stock.__code__, namespace, stock.__name__, stock.__defaults__, stock.__closure__)


@functools.cache
def _field_and_grass() -> tuple[np.ndarray, np.ndarray]:
    """The background square and the grass patches, as (polygons, vertices, 2) arrays in the env's order."""
    from gymnasium.envs.box2d import car_racing as cr

    b, g = cr.PLAYFIELD, cr.GRASS_DIM
    field = np.array([[(b, b), (b, -b), (-b, -b), (-b, b)]], dtype=np.float64)
    grass = np.array([[(g * x + g, g * y), (g * x, g * y), (g * x, g * y + g), (g * x + g, g * y + g)]
                      for x in range(-20, 20, 2) for y in range(-20, 20, 2)], dtype=np.float64)
    return field, grass


class _Track:
    """One track's road polygons as an array (built once a reset: the env makes a new ``road_poly`` list);
    ``vertices`` is None where they are not all quadrilaterals (then the stock pass draws them)."""

    __slots__ = ("road_poly", "vertices", "colors")

    def __init__(self, road_poly: list) -> None:
        self.road_poly = road_poly
        polygons = [[(p[0], p[1]) for p in poly] for poly, _ in road_poly]
        self.vertices = (np.array(polygons, dtype=np.float64).reshape(-1, 4, 2)
                         if all(len(poly) == 4 for poly in polygons) else None)
        self.colors = [color for _, color in road_poly]  # the env's own objects: a tile's is repainted in place


def _on_screen(points: np.ndarray, window: tuple[int, int], margin: float) -> np.ndarray:
    """The polygons with a vertex in the screen grown by ``margin``: gymnasium's test, polygon by polygon."""
    x, y = points[..., 0], points[..., 1]
    inside = (-margin <= x) & (x <= window[0] + margin) & (-margin <= y) & (y <= window[1] + margin)
    return np.flatnonzero(inside.any(axis=-1))


def _render_road(self: Any, zoom: float, translation: Any, angle: float) -> None:
    import pygame
    from gymnasium.envs.box2d import car_racing as cr
    from pygame import gfxdraw

    track = self.__dict__.get("_splitrl_track")
    if track is None or track.road_poly is not self.road_poly:
        track = self.__dict__["_splitrl_track"] = _Track(self.road_poly)
    if track.vertices is None:
        return cr.CarRacing._render_road(self, zoom, translation, angle)
    field, grass = _field_and_grass()

    cos, sin = pygame.math.Vector2(1.0, 0.0).rotate_rad(angle)
    dx, dy = translation[0], translation[1]

    def place(points: np.ndarray) -> np.ndarray:
        x, y = points[..., 0], points[..., 1]
        return np.stack(((cos * x - sin * y) * zoom + dx, (sin * x + cos * y) * zoom + dy), axis=-1)

    def draw(polygon: list, color: Any) -> None:
        gfxdraw.aapolygon(self.surf, polygon, color)
        gfxdraw.filled_polygon(self.surf, polygon, color)

    window, margin = (cr.WINDOW_W, cr.WINDOW_H), cr.MAX_SHAPE_DIM
    draw(place(field)[0].tolist(), self.bg_color)  # never skipped
    placed = place(grass)
    for i in _on_screen(placed, window, margin):
        draw(placed[i].tolist(), self.grass_color)
    placed = place(track.vertices)
    for i in _on_screen(placed, window, margin):
        draw(placed[i].tolist(), [int(c) for c in track.colors[i]])
