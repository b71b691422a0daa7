// Decode steps held in C++ over the integer-dot kernel (`int8dot_cpu`): compiled after its source, in the same
// library, calling its `mm` and `mm_multi` directly. Each computes what the Python step it replaces computes, bit for
// bit, without the Python around its ~40-60 small operations a layer (a decode step of GLM-4.7-Flash is 47 layers of
// them): ATen's operations in the same order, or, for float32 elementwise work, plain loops that round each product
// and sum as ATen's kernels do (this code is compiled outside the kernels' target regions: no fused multiply-adds).

namespace {

// Whether every tensor is float32 (the steps' paths that compute elementwise steps in plain loops take only those)
bool all_float(std::initializer_list<at::Tensor> ts) {
  return std::all_of(ts.begin(), ts.end(), [](const at::Tensor& t) { return t.scalar_type() == at::kFloat; });
}

// A mixture-of-experts layer's decode step over INT weights, held once: the router (transformers' arithmetic, as
// `models/glm/moe_layer.route` computes it: sigmoid scores, top-k of scores + bias, the chosen scores normalized and
// scaled), then the chosen experts in expert order and the shared expert (weight 1) last, each SwiGLU's gate and up in
// one grouped call and the downs in another, summed in that order (`quant/experts.QuantizedExperts.decode_step`):
// the same ATen operations in the same order, so the same bits, without a decode step's Python around them.
struct MoeDecoder : torch::CustomClassHolder {
  std::vector<at::Tensor> w, s;  // per expert (routed 0 .. E-1, then the shared one): gate, up, down
  at::Tensor router, bias;
  int64_t experts, top_k, bits, isa, act_bits;
  bool norm;
  double factor;

  MoeDecoder(std::vector<at::Tensor> weights, std::vector<at::Tensor> scales, int64_t experts, at::Tensor router,
             at::Tensor bias, int64_t top_k, bool norm, double factor, int64_t bits, int64_t isa, int64_t act_bits)
      : w(std::move(weights)), s(std::move(scales)), router(std::move(router)), bias(std::move(bias)),
        experts(experts), top_k(top_k), bits(bits), isa(isa), act_bits(act_bits), norm(norm), factor(factor) {
    TORCH_CHECK(w.size() == s.size() && w.size() % 3 == 0 && static_cast<int64_t>(w.size()) / 3 >= experts,
                "int8dot MoeDecoder: three weights and scales an expert");
  }

  bool shared() const { return static_cast<int64_t>(w.size()) / 3 > experts; }

  // x [1, H] -> [1, H] in x's dtype
  at::Tensor step(const at::Tensor& x) {
    TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "int8dot MoeDecoder: one token, x [1, H]");
    const at::Tensor scores = at::linear(x.to(at::kFloat), router.to(at::kFloat)).sigmoid();
    const at::Tensor index = std::get<1>(at::topk(scores + bias, top_k, -1, true, false));
    at::Tensor weights = scores.gather(1, index);
    if (norm) weights.div_(weights.sum(-1, true) + 1e-20);
    weights = weights * factor;
    std::vector<std::pair<int64_t, int64_t>> chosen;  // (expert, its place among the choices), in expert order
    const at::Tensor picks = index.contiguous();
    const int64_t* picked = picks.data_ptr<int64_t>();
    for (int64_t i = 0; i < top_k; ++i)
      if (picked[i] < experts) chosen.emplace_back(picked[i], i);
    std::sort(chosen.begin(), chosen.end());
    std::vector<int64_t> rows, places;
    for (const auto& c : chosen) rows.push_back(c.first), places.push_back(c.second);
    if (shared()) rows.push_back(experts);
    at::Tensor out = at::zeros_like(x);
    const int64_t n = static_cast<int64_t>(rows.size());
    if (n == 0) return out;
    std::vector<at::Tensor> gw, gs, dw, ds;
    for (int64_t e : rows) {
      for (int64_t j = 0; j < 2; ++j) gw.push_back(w[3 * e + j]), gs.push_back(s[3 * e + j]);
      dw.push_back(w[3 * e + 2]), ds.push_back(s[3 * e + 2]);
    }
    const at::Tensor gate_up = mm_multi(x.expand({2 * n, x.size(0), x.size(1)}), gw, gs, bits, isa, act_bits)
                                   .view({n, 2, x.size(0), -1});
    const at::Tensor down = mm_multi(at::silu(gate_up.select(1, 0)) * gate_up.select(1, 1), dw, ds, bits, isa, act_bits);
    if (all_float({x, down, weights})) return sum_scaled(down, weights.contiguous(), places, out);
    at::Tensor scale = weights[0].index_select(0, at::tensor(places, index.options()));
    if (shared()) scale = at::cat({scale, at::ones({1}, scale.options())});
    const at::Tensor terms = (down * scale.view({-1, 1, 1})).to(out.scalar_type());
    for (int64_t r = 0; r < n; ++r) out.add_(terms[r]);
    return out;
  }

  // The same sum in float32 as a plain loop: out (zeros) += each expert's down [n, 1, H] times its weight (the
  // choice at `places[r]`, the shared expert's 1), in that order, each product and sum rounded as ATen's are
  static at::Tensor sum_scaled(const at::Tensor& down, const at::Tensor& weights, const std::vector<int64_t>& places,
                               at::Tensor out) {
    const int64_t n = down.size(0), width = out.numel();
    const float *pd = down.data_ptr<float>(), *pw = weights.data_ptr<float>();
    float* po = out.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
      const float scale = r < static_cast<int64_t>(places.size()) ? pw[places[r]] : 1.f;
      for (int64_t j = 0; j < width; ++j) {
        const float term = pd[r * width + j] * scale;
        po[j] += term;
      }
    }
    return out;
  }
};

// transformers' RMSNorm of the GLM models (`Glm4MoeLiteRMSNorm`) over one row: its operations, the same bits. The
// mean of squares is ATen's sum (what its mean runs) then a float division; the rest is elementwise and each step is
// rounded as ATen rounds it.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (!all_float({x, weight}) || x.numel() != x.size(-1) || !weight.is_contiguous()) {
    const at::Tensor h = x.to(at::kFloat);
    const at::Tensor variance = h.pow(2).mean(-1, true);
    return weight * (h * at::rsqrt(variance + eps)).to(x.scalar_type());
  }
  const at::Tensor h = x.contiguous();
  const int64_t n = h.numel();
  const float variance = (h * h).sum().item<float>() / static_cast<float>(n);
  const float r = 1.f / std::sqrt(variance + static_cast<float>(eps));
  at::Tensor out = at::empty_like(h);
  const float *ph = h.data_ptr<float>(), *pw = weight.data_ptr<float>();
  float* po = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float normed = ph[i] * r;
    po[i] = pw[i] * normed;
  }
  return out;
}

// A QuantizedLinear (no bias) as its forward runs it on the integer-dot kernel (`quant/kernels.quantized_matmul`)
struct HeldLinear {
  at::Tensor w, s;
  int64_t bits, act;

  at::Tensor operator()(const at::Tensor& x, int64_t isa) const {
    std::vector<int64_t> shape = x.sizes().vec();
    const at::Tensor y = mm(x.reshape({-1, x.size(-1)}), w, s, bits, isa, act, c10::nullopt);
    shape.back() = y.size(1);
    return y.view(shape);
  }
};

// `rotate`'s interleaved form for one token in float32, as plain loops: each head's pairs (x0, x1), (x2, x3), ...
// give [x0 c - x1 s, x2 c - x3 s, ..., x1 c + x0 s, x3 c + x2 s, ...], each product and sum rounded as ATen's do
at::Tensor rotate_pairs(const at::Tensor& t_in, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  const at::Tensor t = t_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t d = t.size(-1), half = d / 2, rows = t.numel() / d;
  at::Tensor out = at::empty_like(t);
  const float *pt = t.data_ptr<float>(), *pc = cos.data_ptr<float>(), *ps = sin.data_ptr<float>();
  float* po = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = pt + r * d;
    float* y = po + r * d;
    for (int64_t j = 0; j < half; ++j) {
      const float even = x[2 * j], odd = x[2 * j + 1], c = pc[j], s = ps[j];
      const float ec = even * c, os = odd * s, oc = odd * c, es = even * s;
      y[j] = ec - os;
      y[half + j] = oc + es;
    }
  }
  return out;
}

// transformers' rotary embedding of GLM-4.7-Flash's shared key and query (`apply_rotary_pos_emb_interleave`, or
// `apply_rotary_pos_emb` where the config's rope_interleave is false): t [b, heads, s, rope], cos / sin [b, s, rope]
at::Tensor rotate(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin, bool interleave) {
  const int64_t d = t.size(-1);
  if (interleave && all_float({t, cos, sin}) && t.size(0) == 1 && t.size(2) == 1) return rotate_pairs(t, cos, sin);
  if (interleave) {
    const at::Tensor c = cos.slice(-1, 0, cos.size(-1) / 2).unsqueeze(1), s = sin.slice(-1, 0, sin.size(-1) / 2).unsqueeze(1);
    const at::Tensor t1 = t.slice(-1, 0, d, 2), t2 = t.slice(-1, 1, d, 2);
    return at::cat({t1 * c - t2 * s, t2 * c + t1 * s}, -1);
  }
  const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  const at::Tensor half = at::cat({-t.slice(-1, d / 2, d), t.slice(-1, 0, d / 2)}, -1);
  return t * c + half * s;
}

// scores [b, H, s, L] with the attention mask as `models/glm/latent_attention._masked` applies it (one query: a
// missing mask hides nothing)
at::Tensor masked(const at::Tensor& scores, const c10::optional<at::Tensor>& mask_in) {
  if (!mask_in) return scores;
  const int64_t length = scores.size(-1), have = mask_in->size(-1);
  const at::Tensor mask = mask_in->slice(-1, std::max<int64_t>(have - length, 0), have);
  if (mask.scalar_type() == at::kBool) return scores.masked_fill(mask.logical_not(), -INFINITY);
  return scores + mask.to(at::kFloat);
}

// A GLM-4.7-Flash decoder layer's one-token decode step (`models/glm/latent_layer`): the input norm, latent attention
// against the cached latents (`models/glm/latent_attention`: the query in the latent space, scores, softmax, the
// value heads, o_proj), the residual, the post-attention norm, the mixture-of-experts step (`MoeDecoder`) and the
// residual. In two calls, around the cache's update: `begin` gives the step's query and the entries to cache,
// `finish` the layer's output from the whole cache.
struct LatentLayer : torch::CustomClassHolder {
  std::vector<HeldLinear> linear;   // q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj
  std::vector<at::Tensor> norm;     // input, q_a, kv_a, post-attention
  std::vector<double> eps;
  std::vector<at::Tensor> key_w, key_s, value_w, value_s;  // the absorbed kv_b_proj, per head
  int64_t key_bits, key_act, value_bits, value_act;
  int64_t heads, nope, rope, value_dim, rank, isa;
  double scaling;
  bool interleave;
  c10::intrusive_ptr<MoeDecoder> moe;

  LatentLayer(std::vector<at::Tensor> weights, std::vector<at::Tensor> scales, std::vector<int64_t> bits,
              std::vector<at::Tensor> norms, std::vector<double> eps, std::vector<at::Tensor> key_w,
              std::vector<at::Tensor> key_s, std::vector<at::Tensor> value_w, std::vector<at::Tensor> value_s,
              std::vector<int64_t> dims, double scaling, bool interleave, c10::intrusive_ptr<MoeDecoder> moe)
      : norm(std::move(norms)), eps(std::move(eps)), key_w(std::move(key_w)), key_s(std::move(key_s)),
        value_w(std::move(value_w)), value_s(std::move(value_s)), scaling(scaling), interleave(interleave),
        moe(std::move(moe)) {
    TORCH_CHECK(weights.size() == 4 && scales.size() == 4 && bits.size() == 12 && norm.size() == 4 &&
                    this->eps.size() == 4 && dims.size() == 6,
                "int8dot LatentLayer: four linears (weight, scale), (bits, activation bits) of them, the absorbed keys "
                "and values, four norms, six sizes");
    for (size_t i = 0; i < 4; ++i) linear.push_back(HeldLinear{weights[i], scales[i], bits[2 * i], bits[2 * i + 1]});
    key_bits = bits[8], key_act = bits[9], value_bits = bits[10], value_act = bits[11];
    heads = dims[0], nope = dims[1], rope = dims[2], value_dim = dims[3], rank = dims[4], isa = dims[5];
  }

  // x [1, 1, hidden], cos / sin [1, 1, rope] -> (the query in the latent space [H, 1, rank], the rotated query
  // [1, H, 1, rope], the normed latent [1, 1, 1, rank] and rotated shared key [1, 1, 1, rope] to cache)
  std::vector<at::Tensor> begin(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && x.size(1) == 1, "int8dot LatentLayer: one token, x [1, 1, hidden]");
    const at::Tensor h = rms_norm(x, norm[0], eps[0]);
    const at::Tensor q = linear[1](rms_norm(linear[0](h, isa), norm[1], eps[1]), isa);
    const auto parts = q.view({1, 1, heads, nope + rope}).transpose(1, 2).split_with_sizes({nope, rope}, -1);
    const auto kv = linear[2](h, isa).split_with_sizes({rank, rope}, -1);
    const at::Tensor latent = rms_norm(kv[0], norm[2], eps[2]).view({1, 1, 1, rank});
    const at::Tensor query = mm_multi(parts[0].to(at::kFloat).transpose(0, 1).reshape({heads, 1, nope}), key_w, key_s,
                                      key_bits, isa, key_act);
    return {query, rotate(parts[1], cos, sin, interleave), latent,
            rotate(kv[1].view({1, 1, 1, rope}), cos, sin, interleave)};
  }

  // x [1, 1, hidden] (begin's), query / q_rot from begin, the whole cache [1, 1, L, rank] / [1, 1, L, rope], the
  // attention mask or none -> the layer's output [1, 1, hidden]
  at::Tensor finish(const at::Tensor& x, const at::Tensor& query, const at::Tensor& q_rot, const at::Tensor& latents,
                    const at::Tensor& k_rots, const c10::optional<at::Tensor>& mask) {
    const at::Tensor keys = latents.to(at::kFloat).select(1, 0), shared = k_rots.to(at::kFloat).select(1, 0);
    const int64_t length = keys.size(1);
    const at::Tensor q = query.view({heads, 1, 1, rank}).transpose(0, 1).reshape({1, heads, rank});
    const at::Tensor scores = (at::matmul(q, keys.transpose(1, 2)) +
                               at::matmul(q_rot.to(at::kFloat).reshape({1, heads, rope}), shared.transpose(1, 2))) * scaling;
    const at::Tensor probs = masked(scores.view({1, heads, 1, length}), mask).softmax(-1);
    const at::Tensor mixed = at::matmul(probs.view({1, heads, length}), keys).view({1, heads, 1, rank}).transpose(0, 1)
                                 .reshape({heads, 1, rank});
    const at::Tensor out = mm_multi(mixed, value_w, value_s, value_bits, isa, value_act).view({heads, 1, 1, value_dim})
                               .permute({1, 2, 0, 3});
    const at::Tensor y = x + linear[3](out.reshape({1, 1, -1}).to(x.scalar_type()), isa);
    const at::Tensor h = rms_norm(y, norm[3], eps[3]);
    return y + moe->step(h.view({-1, h.size(-1)})).view(h.sizes());
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(chatglm_int8dot_cpu, lib) {
  lib.class_<MoeDecoder>("MoeDecoder")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, at::Tensor, at::Tensor, int64_t, bool,
                       double, int64_t, int64_t, int64_t>())
      .def("step", &MoeDecoder::step);
  lib.class_<LatentLayer>("LatentLayer")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>,
                       std::vector<double>, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<int64_t>, double, bool, c10::intrusive_ptr<MoeDecoder>>())
      .def("begin", &LatentLayer::begin)
      .def("finish", &LatentLayer::finish);
}
