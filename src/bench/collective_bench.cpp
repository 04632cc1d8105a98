// The latency of the collectives a distributed decode step issues (bench.h), measured call by
// call on the run's communicator: the messages of one step at each batch size.
#include <algorithm>
#include <vector>

#include "megadecode/base/error.h"
#include "megadecode/base/util.h"
#include "megadecode/bench/bench.h"
#include "megadecode/dist/communicator.h"

namespace md::bench {

std::vector<CollectiveCell> run_collectives(Model& m, const CollectiveOptions& o) {
  dist::Communicator* c = m.communicator();
  MD_CHECK(c && m.shard().sharded(),
           "bench collectives: a distributed run (mpirun -np N megadecode bench --tp/--ep ...)");
  MD_CHECK(o.iters >= 1, "bench collectives: iterations >= 1");
  const ModelConfig& full = m.full_config();
  const int W = c->size();
  std::vector<CollectiveCell> out;
  for (int B : o.batches) {
    // What a decode step of B rows sends: o_proj's and the dense FFN's partial sums (hidden
    // wide), the MoE layers' expert slots and shared expert (k x expert width + hidden), K3's
    // latent blocks, and each rank's vocabulary block of the logits.
    struct Msg {
      const char* what;
      bool gather;
      size_t floats;
    };
    const size_t D = size_t(full.hidden_size);
    std::vector<Msg> msgs = {{"all_reduce attention / dense FFN", false, size_t(B) * D}};
    if (full.num_experts > 0)
      msgs.push_back(
          {"all_reduce MoE (experts + shared)", false,
           size_t(B) * (size_t(full.num_experts_per_token) * size_t(full.expert_dim()) + D)});
    // K3: each MoE layer gathers its latent projections' row blocks (z, then the up-projection).
    if (full.latent_size > 0) {
      msgs.push_back(
          {"all_gather latent z (MoE)", true, size_t(B) * size_t((full.latent_size + W - 1) / W)});
      msgs.push_back({"all_gather latent up (MoE)", true, size_t(B) * ((D + size_t(W) - 1) / W)});
    }
    msgs.push_back({"logits_gather", true, size_t(B) * size_t((full.vocab_size + W - 1) / W)});
    for (const Msg& g : msgs) {
      std::vector<float> buf(g.floats, 1.0f), recv(g.gather ? g.floats * size_t(W) : 0);
      std::vector<double> us;
      for (int i = 0; i < o.iters + 5; ++i) {
        c->barrier();
        const double t0 = now_seconds();
        if (g.gather)
          c->all_gather(buf.data(), recv.data(), g.floats, dist::Elem::kF32);
        else
          c->all_reduce_sum(buf.data(), g.floats, dist::Elem::kF32);
        if (i >= 5) us.push_back((now_seconds() - t0) * 1e6);  // (5 warm-up calls)
        std::fill(buf.begin(), buf.end(), 1.0f);
      }
      std::sort(us.begin(), us.end());
      CollectiveCell cell;
      cell.batch = B;
      cell.what = g.what;
      cell.bytes = double(g.floats) * 4;
      cell.us_median = median(us);
      cell.us_p90 = us[std::min(us.size() - 1, us.size() * 9 / 10)];
      out.push_back(cell);
    }
  }
  return out;
}

}  // namespace md::bench
