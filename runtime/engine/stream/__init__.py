"""The weight-streaming engine: a model's streamed weights copied to the compute device a unit at a time.

A unit is the streamed part of one planned block (a decoder layer's Linears, a generic container with what it
claims), or a streamed leaf outside every block. Its host tensors lie together in one host region (`arena`), so one
copy brings a whole unit into a slot of a fixed ring of device buffers (`streamer`); every kind reads views of its
slot: float leaves' weights and biases, quantized residents' raw storage, generic containers' parameters. The
copies run on a copy stream, ahead of the compute by the ring's depth, each slot guarded by two events; the device
operations stand behind a seam (`device`) that a recording fake implements on a CPU, so the schedule is tested
without a GPU.
"""
