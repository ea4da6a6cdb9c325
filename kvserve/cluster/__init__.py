"""Scale-out: several kvserve engines behind one endpoint (issue #17). This package holds the parts that do not
depend on how replicas are run: the KV-aware router and its index."""
