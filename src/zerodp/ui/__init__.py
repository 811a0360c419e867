"""zerodp.ui: the guide's interactive calculators as a local web page (``zerodp ui``).

- params:   request parameters, declared once, validated once (bad input → HTTP 422)
- api:      endpoint → planner call; every figure is a field of a ``zerodp.plan`` result
- measured: a calibration profile and a Chrome trace, drawn next to the simulation
- server:   stdlib HTTP server for the page, plotly.js from the installed package, the API
- cli:      ``zerodp ui``
"""
