"""Preference data: rows read from any fsspec path (:mod:`~rlhf.data.reading`), parsed from each supported format
into chat messages (:mod:`~rlhf.data.formats`), encoded with the chat template (:mod:`~rlhf.data.chat`), split by
conversation (:mod:`~rlhf.data.splitting`, :mod:`~rlhf.data.sources`), the ptx rows (:mod:`~rlhf.data.ptx`), the
kinds of data every figure is read per (:mod:`~rlhf.data.kinds`) and the Great Expectations suite with its
quarantine (:mod:`~rlhf.data.validation`).

Imports the foundation and :mod:`rlhf.runtime`.
"""
