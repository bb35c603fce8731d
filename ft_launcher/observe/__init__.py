"""What a run cost and how it went: the goodput ledger, the status line, Prometheus metrics,
the HTML timeline, ft_report."""
