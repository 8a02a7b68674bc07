"""CUDA-graph execution: piecewise graphs for prefill/mixed steps, monolithic graphs for decode.

* :mod:`.buckets` chooses the padded sizes graphs are captured at.
* :mod:`.context` holds the capture phase of one runner.
* :mod:`.capture` captures one callable, with the postprocess hook that
  restores inputs a forward mutates.
* :mod:`.piecewise` records the forward as graphs cut at its dynamic (cached) ops and
  replays them with the ops run eagerly between.
* :mod:`.decode` captures the whole forward for decode-only batches.
* :mod:`.runner` dispatches a step to one of them, or to eager execution.

Without CUDA everything runs eagerly through the same code.
"""
