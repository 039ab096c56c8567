"""The performance page's figures, read from bench/results/*.json.

Each function takes the results files (`results.Results`) and returns one section's
figures: the numbers the page prints, the ratios and shares derived from them, and the rows
of its tables. The words around them are bench/performance.md.j2's; bench/report.py fills
that template with these figures.
"""
