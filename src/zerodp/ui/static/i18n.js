// zerodp ui: every word the page shows, in English and Chinese. Terms follow the guide's Chinese:
// 数据并行 (data parallelism), 分桶 (bucketing), 梯度累积 (gradient accumulation),
// 通信屋顶线 (communication roofline), 显存 (GPU memory), 优化器状态, 激活值, 重计算, 微批次.
"use strict";

const I18N = {
  en: {
    "title": "data parallelism, ZeRO and FSDP by the numbers",
    "page.title": "zerodp · data parallelism by the numbers",
    "aria.memory-bars": "stacked bars of bytes per GPU per stage",
    "aria.memory-curve": "bytes per GPU against N for each stage",
    "aria.overlap-lanes": "compute and communication lanes of one backward",
    "aria.overlap-sweep": "exposed communication against bucket size",
    "aria.measured-lanes": "measured compute and communication lanes",
    "aria.roofline-curve": "threshold tokens per GPU against DP size",
    "aria.batch-sweep": "grad_acc against dp",
    "nav.memory": "memory", "nav.overlap": "bucket overlap", "nav.roofline": "roofline", "nav.batch": "batch",
    "lang.label": "Language",
    "memory.title": "Memory per GPU", "memory.model": "Model",
    "memory.params": "Parameters Ψ", "memory.params.hint": "e.g. 7.5e9, 70B",
    "memory.precision": "Precision", "memory.k": "Optimizer bytes/param k",
    "memory.k.hint": "empty: the precision's",
    "memory.n": "Data-parallel GPUs N", "memory.acc": "fp32 gradient accumulation",
    "memory.hbm": "HBM of", "memory.shape": "Shape (empty: the model's; editing makes it custom)",
    "memory.layers": "Layers L", "memory.hidden": "Hidden size h", "memory.heads": "Attention heads",
    "memory.kv_heads": "Key/value heads (GQA)", "memory.ffn": "MLP width (SwiGLU)",
    "memory.vocab": "Vocabulary", "memory.experts": "Routed experts E",
    "memory.experts_per_token": "Experts per token k", "memory.shared_experts": "Shared experts",
    "memory.tied": "tied embeddings",
    "memory.config": "Your model's config.json", "memory.config.file": "Open a config.json",
    "memory.config.paste": "or paste it here",
    "memory.line": "{name}: Ψ = {params}{active}{layers}", "memory.active": ", {n} active per token",
    "memory.layers.n": ", {n} layers",
    "memory.acts": "Activations", "memory.seq": "Sequence length",
    "memory.seq.hint": "empty: not counted", "memory.micro_batch": "Micro-batch",
    "memory.recompute": "Recompute",
    "memory.caption": "Per GPU: the total and whether it fits the HBM; red: it does not.",
    "memory.includes": "total = ", "memory.states": "model states", "memory.fits": "fits",
    "memory.nofit": "does not fit", "memory.activations": "activations",
    "memory.chart": "bytes per GPU", "memory.curve": "total per GPU as the number of GPUs N grows",
    "bar.params": "parameters", "bar.grads": "gradients", "bar.optimizer": "optimizer states",
    "bar.acc": "fp32 grad accumulation", "bar.gathered": "2 gathered units",
    "bar.activations": "activations",
    "overlap.title": "Bucket overlap in one backward", "overlap.bucket": "Bucket size",
    "overlap.tokens": "Tokens per GPU", "overlap.latency": "Small-message latency α′",
    "overlap.bandwidth": "Bandwidth per GPU", "overlap.model": "Model preset",
    "overlap.hardware": "Compute of", "overlap.n": "GPUs in the ring",
    "overlap.collective": "Gradient collective", "overlap.exposed": "exposed communication",
    "overlap.backward": "backward", "overlap.buckets": "buckets", "overlap.comm": "all collectives",
    "overlap.latency_total": "of which latency", "overlap.best": "least exposed: bucket",
    "overlap.measured": "Measured", "overlap.compute": "compute",
    "overlap.time": "time from the start of backward", "overlap.sweep": "exposed communication vs bucket size",
    "overlap.bucketsize": "bucket size", "overlap.lanes": "{model} on {hw} compute: {n} buckets of {size}",
    "overlap.measured.title": "recorded: forward (green), backward (blue), optimizer (grey), collectives (orange)",
    "overlap.measured.time": "time from each rank's first recorded event",
    "roofline.title": "When communication binds (communication roofline)",
    "roofline.hardware": "Hardware", "roofline.n": "Data-parallel GPUs", "roofline.n.hint": "empty: at scale",
    "roofline.axes": "Mesh axes doing DP", "roofline.experts": "Experts E",
    "roofline.experts_per_token": "Experts per token k", "roofline.batch_tokens": "Global batch (tokens)",
    "roofline.nodes": "nodes", "roofline.threshold": "threshold, tokens/GPU",
    "roofline.bottleneck": "bottleneck", "roofline.min_batch": "minimum batch, tokens",
    "roofline.max_devices": "most GPUs for the batch", "roofline.chart": "{hw}: tokens/GPU to be compute-bound",
    "roofline.at_scale": "at scale", "roofline.gpus": "data-parallel GPUs", "roofline.on": "on",
    "batch.title": "Global batch planner", "batch.target": "Target batch (tokens)",
    "batch.seq": "Sequence length", "batch.micro_batch": "Micro-batch mbs", "batch.dp": "Data-parallel GPUs dp",
    "batch.samples": "gbs, samples", "batch.tokens": "gbs, tokens", "batch.grad_acc": "grad_acc (gradient accumulation)",
    "batch.tokens_per_micro": "tokens/GPU per micro-batch",
    "batch.chart": "grad_acc for {samples} samples (red: GPU-rich)", "batch.exact": "exact",
    "batch.rich": "GPU-rich",
    "footer": "Every number on this page comes from zerodp.plan through /api, the same code as zerodp plan.",
    "error.server": "cannot reach the zerodp server",
    "value.intra": "intra (inside a node)", "value.inter": "inter (between nodes)",
    "lever.legend": "Past one node (guide §14)", "lever.shard_size": "Shard group g",
    "lever.shard_size.hint": "empty: flat over N", "lever.compress": "Compression on the wire",
    "memory.comm": "per step: NVLink {intra} · NIC {inter} · {time}",
    "roofline.shard_size": "shard groups", "roofline.wire": "wire bytes/element: gradients, parameters",
    "roofline.sync": "bytes/parameter per GPU: NVLink, NIC share", "value.flat": "flat",
    "hover.long": "long", "hover.bucket": "bucket {i} ({size})", "hover.run": "{n} buckets of {size} after {layer}",
    "hover.sweep": "bucket %{x:.3s}B → exposed %{y:.3s}s<extra></extra>",
    "hover.roofline": "%{x} GPUs: %{y:,.0f} tokens/GPU (%{text})<extra></extra>",
  },
  zh: {
    "title": "数据并行、ZeRO 与 FSDP 的定量计算",
    "page.title": "zerodp · 数据并行的定量计算",
    "aria.memory-bars": "各阶段每卡字节数的堆叠柱状图",
    "aria.memory-curve": "各阶段每卡字节数随 N 的变化",
    "aria.overlap-lanes": "一次反向传播的计算与通信时间线",
    "aria.overlap-sweep": "暴露的通信与桶大小",
    "aria.measured-lanes": "实测的计算与通信时间线",
    "aria.roofline-curve": "阈值（每卡 token 数）随数据并行规模的变化",
    "aria.batch-sweep": "梯度累积步数随 dp 的变化",
    "nav.memory": "显存", "nav.overlap": "分桶重叠", "nav.roofline": "通信屋顶线", "nav.batch": "批次",
    "lang.label": "语言",
    "memory.title": "每卡显存", "memory.model": "模型",
    "memory.params": "参数量 Ψ", "memory.params.hint": "如 7.5e9、70B",
    "memory.precision": "精度", "memory.k": "每参数优化器字节数 k",
    "memory.k.hint": "留空：按精度取默认值",
    "memory.n": "数据并行卡数 N", "memory.acc": "fp32 梯度累积",
    "memory.hbm": "显存容量取自", "memory.shape": "模型结构（留空：用模型自带的；修改即变为 custom）",
    "memory.layers": "层数 L", "memory.hidden": "隐藏维度 h", "memory.heads": "注意力头数",
    "memory.kv_heads": "键值头数（GQA）", "memory.ffn": "MLP 宽度（SwiGLU）",
    "memory.vocab": "词表大小", "memory.experts": "路由专家数 E",
    "memory.experts_per_token": "每个 token 的专家数 k", "memory.shared_experts": "共享专家数",
    "memory.tied": "输入输出嵌入共享",
    "memory.config": "你的模型的 config.json", "memory.config.file": "打开 config.json",
    "memory.config.paste": "或粘贴到这里",
    "memory.line": "{name}：Ψ = {params}{active}{layers}", "memory.active": "，每个 token 激活 {n}",
    "memory.layers.n": "，{n} 层",
    "memory.acts": "激活值", "memory.seq": "序列长度",
    "memory.seq.hint": "留空：不计入", "memory.micro_batch": "微批次",
    "memory.recompute": "重计算",
    "memory.caption": "每卡合计，以及能否放进显存；红色：放不下。",
    "memory.includes": "合计 = ", "memory.states": "模型状态", "memory.fits": "放得下",
    "memory.nofit": "放不下", "memory.activations": "激活值",
    "memory.chart": "每卡字节数", "memory.curve": "每卡合计随数据并行卡数 N 的变化",
    "bar.params": "参数", "bar.grads": "梯度", "bar.optimizer": "优化器状态",
    "bar.acc": "fp32 梯度累积", "bar.gathered": "2 个聚合单元",
    "bar.activations": "激活值",
    "overlap.title": "一次反向传播中的分桶重叠", "overlap.bucket": "桶大小",
    "overlap.tokens": "每卡 token 数", "overlap.latency": "小消息延迟 α′",
    "overlap.bandwidth": "每卡带宽", "overlap.model": "模型",
    "overlap.hardware": "算力取自", "overlap.n": "环内卡数",
    "overlap.collective": "梯度集合通信", "overlap.exposed": "暴露的通信",
    "overlap.backward": "反向传播", "overlap.buckets": "桶数", "overlap.comm": "全部集合通信",
    "overlap.latency_total": "其中延迟", "overlap.best": "暴露最少：桶大小",
    "overlap.measured": "实测", "overlap.compute": "计算",
    "overlap.time": "自反向传播开始的时间", "overlap.sweep": "暴露的通信与桶大小",
    "overlap.bucketsize": "桶大小", "overlap.lanes": "{model}，{hw} 算力：{n} 个 {size} 的桶",
    "overlap.measured.title": "实测：前向（绿）、反向（蓝）、优化器（灰）、集合通信（橙）",
    "overlap.measured.time": "自各 rank 第一个事件起的时间",
    "roofline.title": "何时受通信限制（通信屋顶线）",
    "roofline.hardware": "硬件", "roofline.n": "数据并行卡数", "roofline.n.hint": "留空：大规模",
    "roofline.axes": "做数据并行的网格轴数", "roofline.experts": "专家数 E",
    "roofline.experts_per_token": "每个 token 的专家数 k", "roofline.batch_tokens": "全局批次（token）",
    "roofline.nodes": "节点数", "roofline.threshold": "阈值，每卡 token 数",
    "roofline.bottleneck": "瓶颈", "roofline.min_batch": "最小批次，token",
    "roofline.max_devices": "该批次最多可用卡数", "roofline.chart": "{hw}：受计算限制所需的每卡 token 数",
    "roofline.at_scale": "大规模", "roofline.gpus": "数据并行卡数", "roofline.on": "卡数",
    "batch.title": "全局批次规划", "batch.target": "目标批次（token）",
    "batch.seq": "序列长度", "batch.micro_batch": "微批次 mbs", "batch.dp": "数据并行卡数 dp",
    "batch.samples": "全局批次，样本", "batch.tokens": "全局批次，token", "batch.grad_acc": "梯度累积 grad_acc",
    "batch.tokens_per_micro": "每卡每个微批次的 token",
    "batch.chart": "{samples} 个样本的梯度累积步数（红：GPU 过多）", "batch.exact": "精确值",
    "batch.rich": "GPU 过多",
    "footer": "本页每个数字都来自 zerodp.plan（经 /api），与 zerodp plan 是同一份代码。",
    "error.server": "无法连接 zerodp 服务",
    "value.intra": "节点内", "value.inter": "节点间",
    "lever.legend": "跨节点（指南 §14）", "lever.shard_size": "分片组大小 g",
    "lever.shard_size.hint": "留空：在全部 N 张卡上分片", "lever.compress": "通信压缩",
    "memory.comm": "每步：NVLink {intra} · 网卡 {inter} · {time}",
    "roofline.shard_size": "分片组", "roofline.wire": "每元素传输字节：梯度、参数",
    "roofline.sync": "每卡每参数字节：NVLink、网卡份额", "value.flat": "不分组",
    "hover.long": "长", "hover.bucket": "第 {i} 个桶（{size}）", "hover.run": "{layer} 之后 {n} 个 {size} 的桶",
    "hover.sweep": "桶大小 %{x:.3s}B → 暴露 %{y:.3s}s<extra></extra>",
    "hover.roofline": "%{x} 张卡：每卡 %{y:,.0f} token（%{text}）<extra></extra>",
  },
};

// The page's language: ?lang=zh or ?lang=en in the URL (default English).
function pageLang() {
  const lang = new URLSearchParams(location.search).get("lang");
  return lang === "zh" ? "zh" : "en";
}

// t("overlap.lanes", {model: ...}): the text in the page's language, {names} filled in.
function t(key, vars) {
  const table = I18N[pageLang()];
  let text = key in table ? table[key] : I18N.en[key];
  if (text === undefined) text = key;
  for (const [k, v] of Object.entries(vars || {})) text = text.replace(`{${k}}`, v);
  return text;
}

function applyLang() {
  const lang = pageLang();
  document.documentElement.lang = lang === "zh" ? "zh-CN" : "en";
  document.title = t("page.title");
  for (const el of document.querySelectorAll("[data-i18n]")) el.textContent = t(el.dataset.i18n);
  for (const el of document.querySelectorAll("[data-i18n-aria]")) {
    el.setAttribute("aria-label", t(el.dataset.i18nAria));
  }
  for (const el of document.querySelectorAll("[data-i18n-placeholder]")) {
    el.placeholder = t(el.dataset.i18nPlaceholder);
  }
  for (const a of document.querySelectorAll("[data-lang]")) {
    a.setAttribute("aria-current", a.dataset.lang === lang ? "true" : "false");
  }
}
