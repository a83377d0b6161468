//! PostgreSQL's SQL text as every connector writes it: identifiers and table names quoted one
//! way, and publications looked up and created one way, by the PostgreSQL source (its
//! publication) and the migration's dual write alike.

use tokio_postgres::GenericClient;

/// `name` quoted as an SQL identifier (`"order""s"` for `order"s`).
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `schema`.`name`, both quoted.
pub fn qualified(schema: &str, name: &str) -> String {
    format!("{}.{}", quote_ident(schema), quote_ident(name))
}

/// A table as a file names it (`orders` or `schema.orders`), quoted.
pub fn quote_table(table: &str) -> String {
    match table.split_once('.') {
        Some((schema, name)) => qualified(schema, name),
        None => quote_ident(table),
    }
}

/// What `CREATE PUBLICATION … FOR` covers, from tables as files name them: `schema.table`,
/// `table`, or `schema.*` for every table of a schema; every table when `tables` is empty.
pub fn publication_target(tables: &[String]) -> String {
    if tables.is_empty() {
        return "ALL TABLES".to_owned();
    }
    let parts: Vec<String> = tables
        .iter()
        .map(|t| match t.split_once('.') {
            Some((schema, "*")) => format!("TABLES IN SCHEMA {}", quote_ident(schema)),
            _ => format!("TABLE {}", quote_table(t)),
        })
        .collect();
    parts.join(", ")
}

/// Whether publication `name` exists.
pub async fn publication_exists(
    client: &impl GenericClient,
    name: &str,
) -> Result<bool, tokio_postgres::Error> {
    let row = client
        .query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[&name])
        .await?;
    Ok(row.is_some())
}

/// Creates publication `name` of `tables` ([`publication_target`]).
pub async fn create_publication(
    client: &impl GenericClient,
    name: &str,
    tables: &[String],
) -> Result<(), tokio_postgres::Error> {
    client
        .batch_execute(&format!(
            "CREATE PUBLICATION {} FOR {}",
            quote_ident(name),
            publication_target(tables)
        ))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted_and_their_quotes_doubled() {
        assert_eq!(quote_ident("orders"), "\"orders\"");
        assert_eq!(quote_ident("order\"s"), "\"order\"\"s\"");
        assert_eq!(quote_table("shop.orders"), "\"shop\".\"orders\"");
    }

    #[test]
    fn a_publication_covers_tables_schemas_or_everything() {
        assert_eq!(publication_target(&[]), "ALL TABLES");
        let tables = ["shop.*", "public.orders", "items"].map(String::from);
        assert_eq!(
            publication_target(&tables),
            "TABLES IN SCHEMA \"shop\", TABLE \"public\".\"orders\", TABLE \"items\""
        );
    }
}
