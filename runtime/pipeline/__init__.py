"""One model over several machines: pipeline stages on torch.distributed (gloo over TCP).

A coordinator (`infer run/serve --workers`) keeps the embeddings, the output layer and
the sampler; each worker (`infer worker`) holds a contiguous range of blocks of the same
model file, read from its own disk. A forward pass sends the hidden states from stage to
stage round a ring, coordinator -> worker 1 -> ... -> worker n -> coordinator:

    handshake.py    before any process group: a shared secret proved both ways (HMAC),
                    the model's sha256 compared, layer ranges and the rendezvous agreed
    link.py         one pass on the wire: a small header, the spans, the hidden states
    stage.py        the worker: its blocks, a KV cache per sequence, the loop it serves
    coordinator.py  the coordinator: the blocks callable a model's forward takes

gloo's data plane has no authentication: the links must be on a trusted network.
"""
