"""Development tools that are not part of a deployment: the embedded Kafka broker
(:mod:`daemon.tools.embedded_broker`, ``lpcal broker``), the traffic simulator
(:mod:`daemon.tools.simulate`, ``lpcal simulate``) and the streaming demo
(:mod:`daemon.tools.demo`, ``make demo``). The daemon itself never imports them."""
