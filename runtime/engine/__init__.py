"""The leaf machinery a converted tree runs on: streamed leaves and relocating containers (derived classes), the
protocol they speak, the journal that makes every change undoable, the file tier. Stage 3's verb, which builds on
this and on the plan and quant stages, and the state a converted root keeps, are `runtime.convert`.

Invariants:
- every change goes through a `Journal`: a failure restores every module exactly;
- the engine speaks ComfyUI's low-VRAM attribute names on purpose, stated once in `protocol`.
"""

__all__: list[str] = []
