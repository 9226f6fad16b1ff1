"""Checks an adapter author runs against their framework: the Backend conformance suite (``conformance``)."""
