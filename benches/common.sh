# Shared by the benchmark scripts (sourced, not run): the showcase `products` table
# (../shared/showcase/products.sql), filled.

# create_products ROWS: creates and fills `products` through the caller's `sql` function.
create_products() {
    sql "CREATE TABLE products (
             id          bigint PRIMARY KEY,
             tenant_id   text   NOT NULL,
             sku         text   NOT NULL UNIQUE,
             name        text   NOT NULL,
             price_cents bigint NOT NULL,
             updated_at  timestamptz NOT NULL DEFAULT now()
         );
         ALTER TABLE products REPLICA IDENTITY FULL;
         INSERT INTO products (id, tenant_id, sku, name, price_cents)
             SELECT g, 't' || (g % 100), 'SKU-' || lpad(g::text, 8, '0'), 'product ' || g, 1000 + g % 9000
             FROM generate_series(1, $1) g;"
    sql "VACUUM ANALYZE products"
}

# products_cache_sections: the source, projection and sink sections of the products -> Redis
# pipelines, from the caller's $bench_url, $redis_url, $db and $depth.
products_cache_sections() {
    cat <<TOML
[source]
kind = "postgres"
url = "$bench_url"
tables = ["public.products"]
snapshot = "never"
[projections.cache]
kind = "cache_invalidation"
sinks = ["redis"]
[projections.cache.tables."public.products"]
keys = ["product:{id}:v3", "product:sku:{sku}:v3"]
[sinks.redis]
kind = "redis"
url = "${redis_url%/}/$db"
command = "unlink"
pipeline_depth = $depth
TOML
}
