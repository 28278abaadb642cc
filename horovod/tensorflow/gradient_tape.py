"""DistributedGradientTape: a ``tf.GradientTape`` whose ``gradient()`` returns gradients reduced across ranks."""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Type, cast

import tensorflow as tf

from horovod.common.basics import Average
from horovod.common.process_sets import ProcessSet, global_process_set
from horovod.tensorflow.bridge import not_converted
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.gradient_reducer import GradientReducer


class _DistributedGradientTapeMixin:
    """Methods added to the wrapped tape's class; ``self._hvd_reducer`` does the reduction."""

    _hvd_reducer: GradientReducer

    @not_converted
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE, use_generic_names=False):
        """Like ``tf.GradientTape.gradient``, then reduce the gradients across the ranks of the process set.

        Every rank must call it for the same sources, in the same order.  ``use_generic_names`` is accepted for
        compatibility (op names are deterministic here anyway).
        """
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        reduced = self._hvd_reducer(flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(grads, reduced)

    @not_converted
    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """:meth:`gradient`, split by kind of source.

        Returns:
            ``(local, global)``: lists of ``(source, gradient)`` pairs in the order of ``sources`` — the sources
            registered as local (their gradients stay on this rank, scaled by ``scale_local_gradients``) and the
            others (reduced across the process set).  ``use_generic_names`` is accepted for compatibility.
        """
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(self.gradient(target, sources, output_gradients=output_gradients,
                                                   use_generic_names=use_generic_names))
        local, shared = [], []
        for source, grad in zip(flat_sources, flat_grads):
            (local if self._hvd_reducer.is_local(source) else shared).append((source, grad))
        return local, shared

    def register_local_source(self, source) -> None:
        """Keep ``source``'s gradient local to this rank (not reduced; scaled if ``scale_local_gradients``)."""
        self._hvd_reducer.register_local(source)


_tape_classes: Dict[type, Type[_DistributedGradientTapeMixin]] = {}


def _wrap(gradtape: tf.GradientTape, reducer: GradientReducer) -> tf.GradientTape:
    base = type(gradtape)
    if isinstance(gradtape, _DistributedGradientTapeMixin):
        raise ValueError("The gradient tape is already a DistributedGradientTape; wrap the plain tape once.")
    cls = _tape_classes.get(base)
    if cls is None:
        cls = _tape_classes[base] = cast(Type[_DistributedGradientTapeMixin],
                                         type(base.__name__, (_DistributedGradientTapeMixin, base),
                                              {"__module__": base.__module__}))
    tape = cls.__new__(cls)
    # Share the recorded state: the tape may already have recorded the forward pass, or be entered later.
    tape.__dict__.update(gradtape.__dict__)
    tape._hvd_reducer = reducer
    return tape


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                            compression=Compression.none, sparse_as_dense: bool = False, op: int = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                            process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` averages (by default) the gradients across ranks.

    Works eagerly and inside ``tf.function``.  Dense gradients are reduced as one atomic group by default (one
    negotiation per call, fused by the engine); ``groups`` splits them into ``n`` groups or the given lists of
    variables.  ``device_*`` are accepted for compatibility.

    Args:
        gradtape: a ``tf.GradientTape`` (before or after recording).
        compression: e.g. ``hvd.Compression.fp16``.
        sparse_as_dense: densify ``IndexedSlices`` gradients (e.g. from embeddings) before reducing.
        op: ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum``.
        gradient_predivide_factor: with Average, scale by ``1/f`` before the sum and by ``f`` after.
        num_groups: deprecated; use ``groups``.
        groups: int number of groups, or a list of lists of variables reduced together.
        process_set: ranks to reduce over.
        scale_local_gradients: divide local sources' gradients by the set size (see
            :func:`PartialDistributedGradientTape`).

    Returns:
        A tape of a subclass of ``type(gradtape)``.
    """
    reducer = GradientReducer("DistributedGradientTape", compression, sparse_as_dense, op,
                              gradient_predivide_factor, groups, num_groups, process_set, scale_local_gradients)
    return _wrap(gradtape, reducer)


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                                   compression=Compression.none, sparse_as_dense: bool = False, op: int = Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                                   process_set: ProcessSet = global_process_set,
                                   local_layers: Optional[Iterable] = None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """A :func:`DistributedGradientTape` that keeps the gradients of ``local_layers`` on this rank.

    Args:
        local_layers: a Keras layer or a list of layers whose trainable weights are local (model parallel
            parts). Their gradients are not reduced; with ``scale_local_gradients`` they are divided by the
            process-set size.
    """
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients)
    if local_layers is not None:
        layers = local_layers if isinstance(local_layers, (list, tuple)) else [local_layers]
        for layer in layers:
            if not hasattr(layer, "trainable_weights"):
                raise ValueError(f"local_layers must be Keras layers (with trainable_weights), got {layer!r}.")
            for var in layer.trainable_weights:
                tape.register_local_source(var)
    return tape
