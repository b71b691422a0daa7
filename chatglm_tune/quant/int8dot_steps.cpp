// Decode steps held in C++ over the integer-dot kernel (`int8dot_cpu`): compiled after its source, in the same
// library, calling its `mm` and `mm_multi` directly. Each computes what the Python step it replaces computes, bit for
// bit, without the Python around its ~40-60 small operations a layer (a decode step of GLM-4.7-Flash is 47 layers of
// them): ATen's operations in the same order, or, for float32 elementwise work, plain loops that round each product
// and sum as ATen's kernels do (this code is compiled outside the kernels' target regions: no fused multiply-adds).
// Latent attention's two products are kernels of their own (an AVX2 region), which the Python step calls too.

namespace {

// Whether every tensor is float32 (the steps' paths that compute elementwise steps in plain loops take only those)
bool all_float(std::initializer_list<at::Tensor> ts) {
  return std::all_of(ts.begin(), ts.end(), [](const at::Tensor& t) { return t.scalar_type() == at::kFloat; });
}

// Latent attention's two products against the cached latents (`models/glm/latent_attention`), float32: the scores
// q . k + q_rot . k_rot of every query row with every cached entry, and the probability-weighted sum of the cached
// latents. PyTorch runs the batched products of a decode step's sizes (20 rows, a few hundred entries) on one thread;
// these split the entries (scores) or the latent's columns (sums) over the threads, each output computed whole by one
// thread in a fixed order: the same bits at any thread count, in the Python step and the held one alike.
#pragma GCC push_options
#pragma GCC target("avx2,fma")

// out[i, l] for N rows of q [., R] / qr [., r] (contiguous) and E entries from l of k / kr (row strides ks / krs):
// each load of a query row serves E entries, each load of an entry N rows
template <int N, int E>
void score_entries(const float* q, const float* qr, int64_t R, int64_t r, const float* k, int64_t ks, const float* kr,
                   int64_t krs, int64_t l, float* out, int64_t L) {
  __m256 acc[E][N];
  float tail[E][N];
  for (int e = 0; e < E; ++e)
    for (int i = 0; i < N; ++i) acc[e][i] = _mm256_setzero_ps(), tail[e][i] = 0.f;
  for (int part = 0; part < 2; ++part) {
    const float* a = part ? qr : q;
    const float* b = part ? kr + l * krs : k + l * ks;
    const int64_t width = part ? r : R, stride = part ? krs : ks, whole = width / 8 * 8;
    for (int64_t c = 0; c < whole; c += 8) {
      __m256 kv[E];
      for (int e = 0; e < E; ++e) kv[e] = _mm256_loadu_ps(b + e * stride + c);
      for (int i = 0; i < N; ++i) {
        const __m256 qv = _mm256_loadu_ps(a + i * width + c);
        for (int e = 0; e < E; ++e) acc[e][i] = _mm256_fmadd_ps(qv, kv[e], acc[e][i]);
      }
    }
    for (int64_t c = whole; c < width; ++c)
      for (int e = 0; e < E; ++e)
        for (int i = 0; i < N; ++i) tail[e][i] = std::fma(a[i * width + c], b[e * stride + c], tail[e][i]);
  }
  for (int e = 0; e < E; ++e)
    for (int i = 0; i < N; ++i) out[i * L + l + e] = hsum256(acc[e][i]) + tail[e][i];
}

// The same for entries l0 .. l1, two at a time
template <int N>
void score_rows(const float* q, const float* qr, int64_t R, int64_t r, const float* k, int64_t ks, const float* kr,
                int64_t krs, int64_t l0, int64_t l1, float* out, int64_t L) {
  int64_t l = l0;
  for (; l + 2 <= l1; l += 2) score_entries<N, 2>(q, qr, R, r, k, ks, kr, krs, l, out, L);
  if (l < l1) score_entries<N, 1>(q, qr, R, r, k, ks, kr, krs, l, out, L);
}

// out[i, c0 .. c1] = sum over l in order of p[i, l] k[l, c], for N rows of p [., L] (contiguous), k's row stride ks
template <int N>
void mix_rows(const float* p, int64_t L, const float* k, int64_t ks, int64_t c0, int64_t c1, float* out, int64_t R) {
  int64_t c = c0;
  for (; c + 16 <= c1; c += 16) {
    __m256 acc[2 * N];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t l = 0; l < L; ++l) {
      const __m256 k0 = _mm256_loadu_ps(k + l * ks + c), k1 = _mm256_loadu_ps(k + l * ks + c + 8);
      for (int i = 0; i < N; ++i) {
        const __m256 w = _mm256_set1_ps(p[i * L + l]);
        acc[2 * i] = _mm256_fmadd_ps(w, k0, acc[2 * i]);
        acc[2 * i + 1] = _mm256_fmadd_ps(w, k1, acc[2 * i + 1]);
      }
    }
    for (int i = 0; i < N; ++i) {
      _mm256_storeu_ps(out + i * R + c, acc[2 * i]);
      _mm256_storeu_ps(out + i * R + c + 8, acc[2 * i + 1]);
    }
  }
  for (; c < c1; ++c)
    for (int i = 0; i < N; ++i) {
      float sum = 0.f;
      for (int64_t l = 0; l < L; ++l) sum = std::fma(p[i * L + l], k[l * ks + c], sum);
      out[i * R + c] = sum;
    }
}

// Rows m .. of a product in blocks of 4 (the last block 1-3 rows): f<N>(row) for each block
template <template <int> class F, typename... A>
void in_blocks(int64_t M, A... args) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) F<4>::run(m, args...);
  switch (M - m) {
    case 3: F<3>::run(m, args...); break;
    case 2: F<2>::run(m, args...); break;
    case 1: F<1>::run(m, args...); break;
    default: break;
  }
}

#pragma GCC pop_options

// A float32 view [b, n, width] whose rows are contiguous (the cache's views are), else a contiguous copy
at::Tensor rows_contiguous(const at::Tensor& t) {
  const at::Tensor f = t.to(at::kFloat);
  return f.stride(2) == 1 && f.stride(1) == f.size(2) ? f : f.contiguous();
}

void check_latent(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(2) && a.device().is_cpu(),
              "int8dot ", what, ": [b, rows, width] and [b, entries, width] on the CPU");
}

template <int N>
struct ScoreBlock {
  static void run(int64_t m, const float* q, const float* qr, int64_t R, int64_t r, const float* k, int64_t ks,
                  const float* kr, int64_t krs, int64_t l0, int64_t l1, float* out, int64_t L) {
    score_rows<N>(q + m * R, qr + m * r, R, r, k, ks, kr, krs, l0, l1, out + m * L, L);
  }
};

template <int N>
struct MixBlock {
  static void run(int64_t m, const float* p, int64_t L, const float* k, int64_t ks, int64_t c0, int64_t c1, float* out,
                  int64_t R) {
    mix_rows<N>(p + m * L, L, k, ks, c0, c1, out + m * R, R);
  }
};

// q [b, M, R], qr [b, M, r], keys [b, L, R], shared [b, L, r] -> q keys^T + qr shared^T [b, M, L], float32
at::Tensor latent_scores(const at::Tensor& q_in, const at::Tensor& qr_in, const at::Tensor& keys_in,
                         const at::Tensor& shared_in) {
  check_latent(q_in, keys_in, "latent_scores");
  check_latent(qr_in, shared_in, "latent_scores");
  const at::Tensor q = q_in.to(at::kFloat).contiguous(), qr = qr_in.to(at::kFloat).contiguous();
  const at::Tensor keys = rows_contiguous(keys_in), shared = rows_contiguous(shared_in);
  const int64_t B = q.size(0), M = q.size(1), R = q.size(2), r = qr.size(2), L = keys.size(1);
  TORCH_CHECK(qr.size(1) == M && shared.size(1) == L, "int8dot latent_scores: as many rows and entries in both parts");
  at::Tensor out = at::empty({B, M, L}, q.options());
  const float *pq = q.data_ptr<float>(), *pqr = qr.data_ptr<float>(), *pk = keys.data_ptr<float>(),
              *pkr = shared.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const int64_t chunk = 16, chunks = (L + chunk - 1) / chunk;  // entries a task
  at::parallel_for(0, B * chunks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / chunks, l0 = t % chunks * chunk, l1 = std::min(L, l0 + chunk);
      in_blocks<ScoreBlock>(M, pq + b * M * R, pqr + b * M * r, R, r, pk + b * keys.stride(0), keys.stride(1),
                            pkr + b * shared.stride(0), shared.stride(1), l0, l1, po + b * M * L, L);
    }
  });
  return out;
}

// p [b, M, L], keys [b, L, R] -> p keys [b, M, R], float32
at::Tensor latent_mix(const at::Tensor& p_in, const at::Tensor& keys_in) {
  TORCH_CHECK(p_in.dim() == 3 && keys_in.dim() == 3 && p_in.size(0) == keys_in.size(0) && p_in.size(2) == keys_in.size(1)
                  && p_in.device().is_cpu(),
              "int8dot latent_mix: p [b, rows, L] and keys [b, L, width] on the CPU");
  const at::Tensor p = p_in.to(at::kFloat).contiguous(), keys = rows_contiguous(keys_in);
  const int64_t B = p.size(0), M = p.size(1), L = p.size(2), R = keys.size(2);
  at::Tensor out = at::empty({B, M, R}, p.options());
  const float *pp = p.data_ptr<float>(), *pk = keys.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const int64_t chunk = 64, chunks = (R + chunk - 1) / chunk;  // columns a task
  at::parallel_for(0, B * chunks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / chunks, c0 = t % chunks * chunk, c1 = std::min(R, c0 + chunk);
      in_blocks<MixBlock>(M, pp + b * M * L, L, pk + b * keys.stride(0), keys.stride(1), c0, c1, po + b * M * R, R);
    }
  });
  return out;
}

// A mixture-of-experts layer's decode step over INT weights, held once: the router (transformers' arithmetic, as
// `models/glm/moe_layer.route` computes it: sigmoid scores, top-k of scores + bias, the chosen scores normalized and
// scaled), then the chosen experts in expert order and the shared expert (weight 1) last, each SwiGLU's gate and up in
// one grouped call and the downs in another, summed in that order (`quant/experts.QuantizedExperts.decode_step`):
// the same ATen operations in the same order, so the same bits, without a decode step's Python around them. With no
// routed experts it is a dense MLP's step (GLM-4.7-Flash's first layer), held as the shared expert alone.
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

  // The router's choice for x [1, H]: the chosen experts in expert order, their places among the choices, and the
  // choices' weights [1, top_k] in float32. None without routed experts (a dense MLP held as the shared expert alone).
  std::tuple<std::vector<int64_t>, std::vector<int64_t>, at::Tensor> route(const at::Tensor& x) const {
    std::vector<int64_t> rows, places;
    if (experts == 0) return {rows, places, at::empty({1, 0}, x.options().dtype(at::kFloat))};
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
    for (const auto& c : chosen) rows.push_back(c.first), places.push_back(c.second);
    return {rows, places, weights};
  }

  // x [1, H] -> [1, H] in x's dtype
  at::Tensor step(const at::Tensor& x) {
    TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "int8dot MoeDecoder: one token, x [1, H]");
    auto [rows, places, weights] = route(x);
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
    at::Tensor scale = weights[0].index_select(0, at::tensor(places, weights.options().dtype(at::kLong)));
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
// residual. In two calls around a cache's own update (`begin` gives the step's query and the entries to cache,
// `finish` the layer's output from the whole cache), or in one (`run`) where the cache gives views one entry longer.
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
    const at::Tensor scores = latent_scores(q, q_rot.reshape({1, heads, rope}), keys, shared) * scaling;
    const at::Tensor probs = masked(scores.view({1, heads, 1, length}), mask).softmax(-1);
    const at::Tensor mixed = latent_mix(probs.view({1, heads, length}), keys).view({1, heads, 1, rank}).transpose(0, 1)
                                 .reshape({heads, 1, rank});
    const at::Tensor out = mm_multi(mixed, value_w, value_s, value_bits, isa, value_act).view({heads, 1, 1, value_dim})
                               .permute({1, 2, 0, 3});
    const at::Tensor y = x + linear[3](out.reshape({1, 1, -1}).to(x.scalar_type()), isa);
    const at::Tensor h = rms_norm(y, norm[3], eps[3]);
    return y + moe->step(h.view({-1, h.size(-1)})).view(h.sizes());
  }

  // The whole step in one call: x, cos / sin as `begin` takes them, the cache's entries already made one longer
  // ([1, 1, L, rank] / [1, 1, L, rope], views the cache keeps: the last column is written here), the mask or none
  at::Tensor run(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& latents,
                 const at::Tensor& k_rots, const c10::optional<at::Tensor>& mask) {
    const std::vector<at::Tensor> made = begin(x, cos, sin);
    latents.select(2, -1).copy_(made[2].select(2, 0));
    k_rots.select(2, -1).copy_(made[3].select(2, 0));
    return finish(x, made[0], made[1], latents, k_rots, mask);
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(chatglm_int8dot_cpu, lib) {
  lib.def("latent_scores(Tensor q, Tensor q_rot, Tensor keys, Tensor shared) -> Tensor", &latent_scores);
  lib.def("latent_mix(Tensor p, Tensor keys) -> Tensor", &latent_mix);
  lib.class_<MoeDecoder>("MoeDecoder")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, at::Tensor, at::Tensor, int64_t, bool,
                       double, int64_t, int64_t, int64_t>())
      .def("step", &MoeDecoder::step);
  lib.class_<LatentLayer>("LatentLayer")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>,
                       std::vector<double>, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<int64_t>, double, bool, c10::intrusive_ptr<MoeDecoder>>())
      .def("begin", &LatentLayer::begin)
      .def("finish", &LatentLayer::finish)
      .def("run", &LatentLayer::run);
}
